"""The model folders' flat copies of the shared modules (models/common) are generated, never edited."""

import shutil

from kvm_maglev.models import sync_shared


def test_every_copy_equals_its_shared_module():
    assert sync_shared.stale_copies() == [], "run `python -m kvm_maglev.models.sync_shared`"


def test_check_finds_an_edited_copy_and_the_sync_rewrites_it(tmp_path):
    models = tmp_path / "models"
    shutil.copytree(sync_shared.MODELS_DIR, models, ignore=shutil.ignore_patterns("__pycache__"))
    edited = models / "maglev" / "onednn_linear.py"
    edited.write_text(edited.read_text() + "# edited by hand\n")
    (models / "kvm" / "saved_cache.py").unlink()
    assert sorted(sync_shared.stale_copies(models)) == sorted([edited, models / "kvm" / "saved_cache.py"])
    assert sorted(sync_shared.write_copies(models)) == sorted([edited, models / "kvm" / "saved_cache.py"])
    assert sync_shared.stale_copies(models) == []
    assert edited.read_text().startswith("# Generated from kvm_maglev/models/common/onednn_linear.py")


def test_check_command_exit_status(capsys):
    assert sync_shared.main(["--check"]) == 0
