"""`final_logit_softcapping` (transformers' name, read by TRL) is the same stored value as `logit_softcap`."""

from kvm_maglev.models.maglev.configuration_maglev import MaglevConfig


def test_alias_reads_and_writes_logit_softcap():
    config = MaglevConfig(logit_softcap=12.0)
    assert config.final_logit_softcapping == 12.0
    config.final_logit_softcapping = 7.0
    assert config.logit_softcap == 7.0
    saved = config.to_dict()
    assert "final_logit_softcapping" not in saved and saved["logit_softcap"] == 7.0


def test_old_config_key_loads_and_new_key_is_accepted():
    assert MaglevConfig.from_dict({"logit_softcap": 9.0}).final_logit_softcapping == 9.0
    assert MaglevConfig(final_logit_softcapping=5.0).logit_softcap == 5.0
