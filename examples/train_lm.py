"""Train tiny byte-level language models with and without memory, and compare validation bits per byte.

The paper's claim is language modelling: Maglev beats a matched sliding-window model. Here every arm has
width 64, 2 layers and (where it has one) an attention window of 32 bytes, trains on 256-byte rows for the
same steps with the same data and seed, and is scored on held-out rows: bits per byte with Maglev's P
recurrent on its own memory (and fed by its prefiller), split into the first window and the rest.

Corpora (offline, see kvm_maglev.corpora): "cast" - synthetic stories whose cast of names is stated once at
the start; "stdlib" - this interpreter's standard-library sources, split by file hash.

On cast, the ladder (printed and saved when its arms ran) reads where the memory's gain is lost, past-window BPB
of: an oracle-fed P (its memory input a learned embedding of the story's cast, from the byte after the header),
P fed the prefiller's memories at consistency weight 0 and at the recipe's, and P on its own memory; beside it a
linear probe of cast membership from each model's memory (or the sliding window's head input) by distance
from the header, fit on training rows and scored on validation rows.

    python examples/train_lm.py --corpus cast --seed 0 --out results/lm_cast_s0
    python examples/train_lm.py --corpus cast --seed 100 --steps 600 --arms ladder --out results/lm_ladder_s100
"""

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

from kvm_maglev import KVMConfig, KVMForCausalLM, MaglevConfig, MaglevForCausalLM
from kvm_maglev.corpora import cast_corpus, cast_header, name_pool, pack_bytes, stdlib_corpus
from kvm_maglev.models.kvm.modeling_kvm import KVMSlidingWindowAttention
from kvm_maglev.models.maglev.modeling_maglev import rms_norm
from kvm_maglev.recall import memory_prefill
from kvm_maglev.training import (
    MAGLEV_RECIPE,
    MAGLEV_RECIPES,
    MaglevRecurrentFrom,
    MaglevStepCallback,
    maglev_recipe_callbacks,
)

WIDTH, LAYERS, HEADS, WINDOW, SEQ_LEN, VOCAB = 64, 2, 2, 32, 256, 257  # 256 bytes + BOS
BOS = 256
EVAL_SEED_OFFSET = 10_000
CAST_DOCUMENTS = 40_000  # training stories drawn at least (one row each): one epoch up to 2400 steps of 16
CAST_POOL = name_pool(200, seed=0)  # cast_corpus's names, the same for every seed
PROBE_ROWS = 512  # training rows the cast-membership probe is fit on
PROBE_DISTANCES = ((0, 32), (32, 64), (64, 128), (128, SEQ_LEN))  # bytes after the header's "."
PROBE_FIT_SAMPLES = 8192  # positions per distance band the probe is fit on (a fixed random subset)


def _nanochat(**fields) -> MaglevForCausalLM:
    base = dict(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=HEADS, max_position_embeddings=SEQ_LEN, window_pattern="L", weight_init="torch")
    return MaglevForCausalLM(MaglevConfig(**{**base, **fields}))


def _maglev(**recipe) -> MaglevForCausalLM:
    base = dict(use_memory=True, sliding_window=WINDOW, has_prefiller=True, prefiller_window_pattern="L",
                prefiller_shares_blocks=False, consistency_weight=0.1)
    return _nanochat(**{**base, **recipe})


def _kvm(window_chunks: int) -> KVMForCausalLM:
    """KVM with 16-byte chunks, a one-sink 32-slot fixed state and `window_chunks` chunks of window."""
    return KVMForCausalLM(KVMConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, chunk_size=16,
        window_chunks=window_chunks, sink_slots=1, state_budget_mode="fixed", state_budget_min=32,
        state_max_chunks=2))


def _kvm_backbone_sliding_window() -> KVMForCausalLM:
    """KVM's backbone with a plain WINDOW-byte sliding window and no state (an experimental arm: KVMConfig
    cannot make every layer a sliding-window layer, so each KVM attention is swapped for the sliding-window
    mixer, which keeps the token shift, value residual and KVM's rotary channels)."""
    model = _kvm(window_chunks=WINDOW // 16)
    model.config.sliding_window = WINDOW
    for layer in model.model.layers:
        layer.self_attn = KVMSlidingWindowAttention(model.config, layer.self_attn.layer_idx)
        for module in layer.self_attn.modules():
            model._init_weights(module)
    return model


class CastOracleFed(nn.Module):
    """Maglev's P with its memory input replaced by a learned embedding of the story's cast (an experimental arm
    bounding what a memory could give): `unread` up to the header's closing ".", then rms_norm of the sum of
    the cast members' embeddings. No prefiller, no consistency loss."""

    def __init__(self, maglev: MaglevForCausalLM, pool_size: int):
        super().__init__()
        self.maglev = maglev
        self.config = maglev.config
        self.cast_embedding = nn.Embedding(pool_size, maglev.config.hidden_size)
        self.unread = nn.Parameter(torch.zeros(maglev.config.hidden_size))

    def memory_inputs(self, cast: torch.Tensor, header_end: torch.Tensor, length: int) -> torch.Tensor:
        """mu [batch, length, width]: position t reads the cast code once byte t - 1 closed the header."""
        code = rms_norm(self.cast_embedding(cast).sum(dim=1), self.config.rms_norm_eps)  # [batch, width]
        read = torch.arange(length, device=cast.device)[None, :] > header_end[:, None]
        return torch.where(read[..., None], code[:, None, :], self.unread)

    def forward(self, input_ids: torch.Tensor, cast: torch.Tensor, header_end: torch.Tensor,
                labels: torch.Tensor | None = None, **kwargs: Any):
        mu = self.memory_inputs(cast, header_end, input_ids.shape[1])
        return self.maglev(input_ids=input_ids, labels=labels, memory_inputs=mu, **kwargs)


class SelfFeedFrom(TrainerCallback):
    """Runs `passes` self-fed passes from optimizer step `step` on (none before): the teacher schedule's second
    half, where P trains on its own rollouts against the frozen prefiller."""

    def __init__(self, step: int, passes: int):
        self.step, self.passes = step, passes

    def on_step_begin(self, args, state, control, model: nn.Module | None = None, **kwargs) -> None:
        model.config.memory_self_feed_steps = self.passes if state.global_step >= self.step else 0


def _teacher(steps: int, weight: float, **extra) -> MaglevForCausalLM:
    """The teacher schedule: consistency weight 0 and P fed the prefiller Q for the first half (Q and P train
    freely), then Q frozen as a teacher, weight `weight`, two self-fed passes (SelfFeedFrom); memory projection."""
    return _maglev(consistency_weight=0.0, memory_projection=True, consistency_detach_target_after=steps // 2,
                   consistency_weight_after_detach=weight, **extra)


# trains on P's own recurrent rollouts from optimizer step `step` on (the lifted recipe before it)
RecurrentFrom = MaglevRecurrentFrom

# lifted-then-recurrent arms: name -> (share of the steps trained lifted, MAGLEV_RECIPES fields of that phase). The
# recipe `self_feed2_then_recurrent_late` (self_feed2, then P on its own rollouts for the last quarter) is a named
# recipe with a schedule (MAGLEV_SCHEDULES), so its arm is `maglev_self_feed2_then_recurrent_late` like every recipe's.
SWITCH_ARMS: dict[str, tuple] = {
    "maglev_w0_then_recurrent": (0.5, MAGLEV_RECIPES["self_feed2_w0"]),
    "maglev_w0_then_recurrent_late": (0.75, MAGLEV_RECIPES["self_feed2_w0"]),
    "maglev_w0_then_recurrent_residual": (0.5, {**MAGLEV_RECIPES["self_feed2_w0"], "memory_residual_injection": True}),
}

# the teacher-schedule arms: name -> (consistency weight after the switch, extra config fields)
TEACHER_ARMS: dict[str, tuple] = {
    "maglev_teacher_w1": (1.0, {}),
    "maglev_teacher_w3": (3.0, {}),
    "maglev_teacher_w1_residual": (1.0, {"memory_residual_injection": True}),
}

# every arm: name -> builder(training steps)
ARMS: dict[str, Callable[[int], nn.Module]] = {
    "swa_baseline": lambda steps: _nanochat(use_memory=False, sliding_window=WINDOW, has_prefiller=False),
    **{f"maglev_{name}": (lambda steps, recipe=recipe: _maglev(**recipe)) for name, recipe in MAGLEV_RECIPES.items()},
    # the shipped recipe under the name train_recall.py and the examples give it
    "maglev": lambda steps: _maglev(**MAGLEV_RECIPES[MAGLEV_RECIPE]),
    **{name: (lambda steps, spec=spec: _teacher(steps, spec[0], **spec[1])) for name, spec in TEACHER_ARMS.items()},
    **{name: (lambda steps, spec=spec: _maglev(**spec[1])) for name, spec in SWITCH_ARMS.items()},
    # P alone (no prefiller) trained on its own rollouts from the first step: backpropagation through time
    "maglev_recurrent": lambda steps: _nanochat(use_memory=True, sliding_window=WINDOW, has_prefiller=False,
                                                training_forward="recurrent"),
    "oracle_fed": lambda steps: CastOracleFed(_nanochat(use_memory=True, sliding_window=WINDOW, has_prefiller=False),
                                              len(CAST_POOL)),
    "kvm_fixed": lambda steps: _kvm(window_chunks=WINDOW // 16),
    # KVM's backbone (token shift, value residual, its norms) with a window over the whole row: no block ever
    # leaves the window, so no state is read - full attention on KVM's backbone, to tell backbone from memory
    "kvm_backbone_full": lambda steps: _kvm(window_chunks=SEQ_LEN // 16),
    "kvm_backbone_swa": lambda steps: _kvm_backbone_sliding_window(),
    "full_attention": lambda steps: _nanochat(use_memory=False, sliding_window=None, has_prefiller=False),
}

# what the memory issue compares: the sliding window, the paper's recipe, the examples' recipe, KVM, the ceiling
DEFAULT_ARMS = ("swa_baseline", "maglev_paper", f"maglev_{MAGLEV_RECIPE}", "kvm_fixed", "full_attention")
# the ladder's rungs: (label, arm, evaluation mode); "--arms ladder" trains their arms
LADDER = (
    ("oracle-fed (cast embedding)", "oracle_fed", "oracle"),
    ("prefiller-fed, consistency weight 0", "maglev_paper_w0", "prefiller"),
    ("prefiller-fed, consistency weight 0.1 (paper)", "maglev_paper", "prefiller"),
    (f"prefiller-fed, {MAGLEV_RECIPE} (weight 0.1)", f"maglev_{MAGLEV_RECIPE}", "prefiller"),
    (f"own memory, {MAGLEV_RECIPE}", f"maglev_{MAGLEV_RECIPE}", "recurrent"),
    ("own memory, paper (weight 0.1)", "maglev_paper", "recurrent"),
    ("sliding window", "swa_baseline", "recurrent"),
)
LADDER_ARMS = list(dict.fromkeys(arm for _, arm, _ in LADDER))


def cast_labels(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per cast-corpus row (a story's opening): `cast` [rows, 3] pool indices and `header_end` [rows], the row
    position of the header's closing "."."""
    index = {name: i for i, name in enumerate(CAST_POOL)}
    casts, ends = [], []
    for row in rows.tolist():
        names, end = cast_header(bytes(row[1:]))
        casts.append([index[name] for name in names])
        ends.append(end + 1)  # row position 0 is BOS
    return {"cast": torch.tensor(casts), "header_end": torch.tensor(ends)}


def corpus_rows(name: str, seed: int, header_offset: int = 0, min_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, validation rows) of SEQ_LEN byte ids; validation never shares a document with training.
    On cast, `header_offset` > 0 puts each story's header 0 to that many bytes into its row, and enough stories
    are drawn for `min_rows` rows (the story stream is seeded, so runs that need fewer keep the same rows)."""
    if name == "cast":
        documents = max(CAST_DOCUMENTS, math.ceil(min_rows * 1.02))  # ~0.3% of stories are shorter than a row
        train = pack_bytes(cast_corpus(documents, seed=seed, preamble_bytes=header_offset), SEQ_LEN, BOS,
                           rows_per_document=1)
        validation = pack_bytes(cast_corpus(512, seed=EVAL_SEED_OFFSET + seed, preamble_bytes=header_offset),
                                SEQ_LEN, BOS, rows_per_document=1)
        return train, validation
    if header_offset:
        raise ValueError("--header-offset shifts the cast corpus's header; the stdlib corpus has none")
    train = pack_bytes(stdlib_corpus("train"), SEQ_LEN, BOS)
    validation = pack_bytes(stdlib_corpus("validation"), SEQ_LEN, BOS)
    pick = torch.randperm(validation.shape[0], generator=torch.Generator().manual_seed(EVAL_SEED_OFFSET))[:512]
    return train, validation[pick]


def arm_recipe(name: str) -> str | None:
    """The MAGLEV_RECIPES entry an arm trains with (`maglev` the shipped one), None for other arms."""
    if name == "maglev":
        return MAGLEV_RECIPE
    recipe = name[len("maglev_"):] if name.startswith("maglev_") else None
    return recipe if recipe in MAGLEV_RECIPES else None


def arm_callbacks(name: str, model: nn.Module, steps: int) -> list[TrainerCallback]:
    """The callbacks of a Maglev arm's recipe (the step callback; a recipe's schedule), the teacher arms'
    self-feeding from half way and the switch arms' move to recurrent training."""
    callbacks: list[TrainerCallback] = []
    if isinstance(model, MaglevForCausalLM):
        recipe = arm_recipe(name)
        callbacks = maglev_recipe_callbacks(recipe, steps) if recipe else [MaglevStepCallback()]
    if name in TEACHER_ARMS:
        callbacks.append(SelfFeedFrom(steps // 2, passes=2))
    if name in SWITCH_ARMS:
        callbacks.append(RecurrentFrom(round(steps * SWITCH_ARMS[name][0])))
    return callbacks


def train_one(name: str, rows: torch.Tensor, labels: dict[str, torch.Tensor] | None,
              args: argparse.Namespace) -> nn.Module:
    set_seed(args.seed)
    model = ARMS[name](args.steps)
    if isinstance(model, CastOracleFed) and labels is None:
        raise ValueError("the oracle-fed arm needs the cast corpus (it is fed each story's cast)")
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(args.seed))
    data = []
    for i in order[: args.steps * args.batch_size].tolist():
        data.append({"input_ids": rows[i], "labels": rows[i]})
        if isinstance(model, CastOracleFed):
            data[-1].update({key: value[i] for key, value in labels.items()})
    training_args = TrainingArguments(
        output_dir=str(args.out / "trainer" / name), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.steps // 20), weight_decay=0.0,
        logging_steps=max(1, args.steps // 10), save_strategy="no", report_to=[], seed=args.seed,
        use_cpu=not torch.cuda.is_available(), remove_unused_columns=False, disable_tqdm=not args.progress,
    )
    callbacks = arm_callbacks(name, model, args.steps)
    Trainer(model=model, args=training_args, train_dataset=data, callbacks=callbacks).train()
    return model.eval()


def eval_modes(model: nn.Module) -> dict[str, str]:
    """Result key -> Maglev prompt mode ("" leaves the model alone) under which a model is scored."""
    if isinstance(model, CastOracleFed):
        return {"oracle": ""}
    if isinstance(model, MaglevForCausalLM) and model.config.use_memory:
        return {"recurrent": "recurrent", **({"prefiller": "prefiller"} if model.config.has_prefiller else {})}
    return {"recurrent": ""}


def probe_features(outputs: Any, mode: str) -> dict[str, torch.Tensor]:
    """What the probe reads from a base model's output: P's memories (own in "recurrent" mode, fed the prefiller's
    in "prefiller" mode), the prefiller's, or, without memory, the head input."""
    if outputs.memories is None:
        return {"head_input": outputs.last_hidden_state}
    found = {"own_memory" if mode == "recurrent" else "prefiller_fed_memory": outputs.memories}
    if outputs.prefiller_memories is not None:
        found["prefiller_memory"] = outputs.prefiller_memories
    return found


@torch.no_grad()
def score(model: nn.Module, rows: torch.Tensor, labels: dict[str, torch.Tensor] | None, mode: str, batch: int,
          progress: bool, keep_features: bool) -> tuple:
    """(per-byte nats [rows, SEQ_LEN - 1], {feature name: [rows, SEQ_LEN, width]} when kept) of the uncached
    forward in the given Maglev prompt mode; the oracle-fed arm reads each row's cast."""
    base = model.maglev.model if isinstance(model, CastOracleFed) else getattr(model, "model", None)
    captured: list[Any] = []
    hook = base.register_forward_hook(lambda module, inputs, output: captured.append(output)) \
        if keep_features and base is not None else None
    losses, features = [], {}
    try:
        with memory_prefill(model, mode):
            for start in tqdm(range(0, rows.shape[0], batch), desc=f"eval {mode or 'model'}", disable=not progress):
                ids = rows[start:start + batch]
                extra = {} if not isinstance(model, CastOracleFed) else \
                    {key: value[start:start + batch] for key, value in labels.items()}
                logits = model(input_ids=ids, use_cache=False, **extra).logits[:, :-1]
                losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                              reduction="none").view(ids.shape[0], -1))
                for key, value in (probe_features(captured.pop(), mode) if hook else {}).items():
                    features.setdefault(key, []).append(value.float())
    finally:
        if hook is not None:
            hook.remove()
    return torch.cat(losses), {key: torch.cat(parts) for key, parts in features.items()}


def bits(nats: torch.Tensor) -> dict[str, float]:
    """Bits per byte over all predicted bytes, the first window's and the rest's (column j predicts byte j + 1)."""
    return {"all": nats.mean().item() / math.log(2), "first_window": nats[:, : WINDOW - 1].mean().item() / math.log(2),
            "past_window": nats[:, WINDOW - 1:].mean().item() / math.log(2)}


def distance_samples(features: torch.Tensor, header_end: torch.Tensor, cast: torch.Tensor, low: int, high: int):
    """(features [n, width], multi-hot cast [n, pool]) of every position t whose distance t - header_end from the
    header's closing "." is in [low, high): the memory written after reading byte t."""
    distance = torch.arange(features.shape[1])[None, :] - header_end[:, None]
    row, column = torch.nonzero((distance >= low) & (distance < high), as_tuple=True)
    targets = torch.zeros(row.shape[0], len(CAST_POOL))
    targets.scatter_(1, cast[row], 1.0)
    return features[row, column], targets


def fit_probe(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-4, iterations: int = 100) -> nn.Linear:
    """A linear multi-label probe (logistic regression, full-batch L-BFGS) of cast membership."""
    probe = nn.Linear(x.shape[1], y.shape[1])
    optimizer = torch.optim.LBFGS(probe.parameters(), max_iter=iterations, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(probe(x), y) + l2 * probe.weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return probe


def cast_probe(train: torch.Tensor, train_labels: dict[str, torch.Tensor], validation: torch.Tensor,
               validation_labels: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per distance band from the header: top-3 recall on validation rows (the share of the cast among the probe's
    three highest-scoring names; chance 3/200) of a linear probe fit on training rows' features."""
    result = {}
    for low, high in PROBE_DISTANCES:
        x, y = distance_samples(train, train_labels["header_end"], train_labels["cast"], low, high)
        keep = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(low))[:PROBE_FIT_SAMPLES]
        probe = fit_probe(x[keep], y[keep])
        vx, vy = distance_samples(validation, validation_labels["header_end"], validation_labels["cast"], low, high)
        with torch.no_grad():
            top = probe(vx).topk(3, dim=1).indices
        result[f"{low}-{high}"] = vy.gather(1, top).sum(dim=1).div(3).mean().item()
    return result


def ladder_rows(results: dict[str, dict]) -> list[dict]:
    """The ladder's rungs whose arms ran: BPB and the past-window change against the sliding window."""
    baseline = results.get("swa_baseline", {}).get("recurrent", {}).get("past_window")
    rows = []
    for label, arm, mode in LADDER:
        if mode in results.get(arm, {}):
            row = {"rung": label, "arm": arm, "mode": mode, **results[arm][mode]}
            if baseline:
                row["past_vs_sliding_window"] = row["past_window"] / baseline - 1
            rows.append(row)
    return rows


def evaluate(model: nn.Module, rows: torch.Tensor, probe_rows: torch.Tensor | None,
             labels: dict[str, torch.Tensor] | None, probe_labels: dict[str, torch.Tensor] | None,
             args: argparse.Namespace) -> dict[str, Any]:
    """BPB per evaluation mode; on cast also the cast-membership probe of every feature the model exposes."""
    result: dict[str, Any] = {}
    probe = labels is not None and not isinstance(model, CastOracleFed) and not isinstance(model, KVMForCausalLM)
    for key, mode in eval_modes(model).items():
        nats, features = score(model, rows, labels, mode, args.eval_batch, args.progress, keep_features=probe)
        result[key] = bits(nats)
        if probe:
            _, fit_features = score(model, probe_rows, probe_labels, mode, args.eval_batch, args.progress, True)
            for name, validation in features.items():
                result.setdefault("probe", {})[name] = cast_probe(fit_features[name], probe_labels, validation,
                                                                  labels)
    return result


def main(argv: list[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--corpus", choices=("cast", "stdlib"), default="cast")
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS) + ["ladder"], default=list(DEFAULT_ARMS),
                        help="arms to train in turn; 'ladder' stands for the ladder's arms")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--header-offset", type=int, default=0,
                        help="cast: each story's header starts 0 to this many bytes into its row, after "
                             "setting sentences (0: at the row's start)")
    parser.add_argument("--eval-batch", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/lm"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--save-models", type=Path, default=None,
                        help="write each trained arm's folder (config and weights) to DIR/<arm>, e.g. for "
                             "kvm_maglev.benchmarks.prompt_modes; the oracle-fed arm is a wrapper and is not saved")
    args = parser.parse_args(argv)
    command = (f"python examples/train_lm.py --corpus {args.corpus} --seed {args.seed} --steps {args.steps} "
               f"--arms {' '.join(args.arms)} --out {args.out}" + (f" --threads {args.threads}" if args.threads else "")
               + (f" --header-offset {args.header_offset}" if args.header_offset else "")
               + (f" --save-models {args.save_models}" if args.save_models else ""))
    args.arms = list(dict.fromkeys(arm for name in args.arms for arm in (LADDER_ARMS if name == "ladder" else [name])))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    train_rows, validation_rows = corpus_rows(args.corpus, args.seed, args.header_offset, args.steps * args.batch_size)
    probe_rows = train_rows[:PROBE_ROWS]
    cast = args.corpus == "cast"
    labels, probe_labels = (cast_labels(validation_rows), cast_labels(probe_rows)) if cast else (None, None)
    results, timings = {}, {}
    for name in args.arms:
        start = time.time()
        model = train_one(name, train_rows, cast_labels(train_rows) if cast and name == "oracle_fed" else None, args)
        timings[name] = time.time() - start
        if args.save_models is not None and not isinstance(model, CastOracleFed):
            model.save_pretrained(args.save_models / name)
        results[name] = evaluate(model, validation_rows, probe_rows, labels, probe_labels, args)
        results[name].update(window=WINDOW)
        print(name, f"{timings[name]:.0f}s", json.dumps(results[name]), flush=True)
        summary = {
            "command": command, "corpus": args.corpus, "train_rows": train_rows.shape[0],
            "epochs": args.steps * args.batch_size / train_rows.shape[0],
            "validation_rows": validation_rows.shape[0], "settings": {k: str(v) for k, v in vars(args).items()},
            "train_seconds": timings, "models": results, "ladder": ladder_rows(results),
        }
        (args.out / "lm.json").write_text(json.dumps(summary, indent=1))
    for row in summary["ladder"]:
        change = f"  past window {100 * row['past_vs_sliding_window']:+.1f}% vs sliding window" \
            if "past_vs_sliding_window" in row else ""
        print(f"ladder  {row['rung']:<48} BPB {row['all']:.4f}  past window {row['past_window']:.4f}{change}")
    for name, row in results.items():
        for feature, bands in row.get("probe", {}).items():
            print(f"probe  {name:<24} {feature:<22} top-3 cast recall by distance:",
                  "  ".join(f"{band} {100 * value:.0f}%" for band, value in bands.items()))
    print(f"wrote {args.out / 'lm.json'}", flush=True)


if __name__ == "__main__":
    main()
