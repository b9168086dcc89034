"""The decoding attention over an engine's pages as one compiled CPU kernel (`paged_attention_cpu.c`): each request's
one query over segments of keys and values lying in its pages - KVM's live state slots and visible window slots,
each with its temperature; Maglev's ring and set-aside key - in one softmax, reading each page where it lies, as far
as the request reads it, in one call for all requests and heads. The torch paths it replaces (`in_place_reads`: a
request at a time, or every request's pages gathered) spend most of a small model's step in operator calls and
copies; this reads the bytes once (docs/serving.md, `python -m kvm_maglev.benchmarks.engine_attention`).

The same library holds KVM's token shift over the carries in the pages (`shift_tokens`: a step's shift of every
request's tokens, the carries' write and the padding's zeros in one call instead of six operators a stream).

The C source is compiled on first use with the machine's C compiler (`$CC`, else `cc`) into
`$KVM_MAGLEV_CACHE` (default `~/.cache/kvm_maglev`), named by a hash of the source, flags and compiler, and loaded
with ctypes; it needs no torch headers (a build takes well under a second). Without a compiler, where the build
fails, or with `KVM_MAGLEV_CPU_KERNEL=0`, callers keep the torch paths (`available()` is False), which stay the
reference the kernel equals (tests/models/kvm/test_paged_attention_cpu.py). Float32 and bfloat16 pages.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention_cpu.c")
PAGE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the element types the kernel reads, as its `bfloat16` flag
MAX_GROUPS = 64  # query heads per key/value head the kernel holds (MAX_GROUPS in the source)
# value-changing rewrites the kernel's sums may take: reassociation lets the compiler vectorise its dot products
# (sums in another order, as a batched product's are); no flag that changes the process's floating-point state
BASE_FLAGS = ["-O3", "-shared", "-fPIC", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
              "-fno-trapping-math"]


class Segment(ctypes.Structure):
    """`segment_t` of the source: one segment's page tensors, strides, and each request's page, read slots, seen
    slots and each query head's logit factor."""

    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("pages", ctypes.c_int64),
                ("slots", ctypes.c_int64), ("key_strides", ctypes.c_int64 * 3),
                ("value_strides", ctypes.c_int64 * 3), ("page", ctypes.c_void_p), ("length", ctypes.c_void_p),
                ("visible", ctypes.c_void_p), ("visible_stride", ctypes.c_int64), ("head_scale", ctypes.c_void_p)]


@dataclass
class PagedSegment:
    """One segment a request attends over: `keys` [pages, kv heads, slots, dim] and `values` [..., value dim] (any
    strides but a contiguous last dimension), request r's page `page[r]`, its first `length[r]` slots read (int64,
    [requests]) of which it sees those `visible[r]` marks ([requests, >= slots read], bool; None: all), each query
    head's logits multiplied by `head_scale` [heads] (softmax scale times temperature)."""

    keys: torch.Tensor
    values: torch.Tensor
    page: torch.Tensor
    length: torch.Tensor
    visible: torch.Tensor | None
    head_scale: torch.Tensor


def cache_dir() -> Path:
    return Path(os.environ.get("KVM_MAGLEV_CACHE") or Path.home() / ".cache" / "kvm_maglev")


def compile_flags() -> list[list[str]]:
    """Flag sets to try in turn: with OpenMP (threads split the requests when torch has several) and without; AVX2
    and FMA where torch found them on this CPU."""
    vector = ["-mavx2", "-mfma"] if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else []
    return [BASE_FLAGS + vector + ["-fopenmp"], BASE_FLAGS + vector]


def build(compiler: str, flags: list[str]) -> Path:
    """The shared library of the source for `compiler` and `flags`, compiled unless the cache holds it (written
    to a temporary name and renamed: a build cut short leaves no library behind)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = cache_dir() / f"paged_attention_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *flags, "-o", str(built), str(SOURCE), "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(built, target)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel's library, built on first use; None (the reason logged once) where it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found ($CC, cc, gcc): the decoding attention over pages keeps its torch path")
        return None
    errors = []
    for flags in compile_flags():
        try:
            loaded = ctypes.CDLL(str(build(compiler, flags)))
        except (OSError, subprocess.CalledProcessError) as error:
            errors.append(getattr(error, "stderr", None) or str(error))
            continue
        loaded.attend_segments.restype = ctypes.c_int
        loaded.attend_segments.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 5
                                           + [ctypes.c_int, ctypes.POINTER(Segment), ctypes.c_int64, ctypes.c_int64,
                                              ctypes.c_int, ctypes.c_void_p])
        loaded.shift_tokens.restype = ctypes.c_int
        loaded.shift_tokens.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
                                        + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 4
                                        + [ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]
                                        + [ctypes.c_int64] * 2)
        return loaded
    logger.warning("the CPU decoding attention kernel did not build (%s): its torch path is used instead",
                   errors[-1].strip())
    return None


def available() -> bool:
    """Whether the kernel may run: not turned off (`KVM_MAGLEV_CPU_KERNEL=0`) and built."""
    return os.environ.get("KVM_MAGLEV_CPU_KERNEL", "1") != "0" and library() is not None


def reads(q: torch.Tensor, *pages: torch.Tensor) -> bool:
    """Whether the kernel serves a decoding attention of queries `q` over page tensors `pages`: on CPU, outside
    compiled graphs, pages of one element type it reads with contiguous rows, at most `MAX_GROUPS` query heads a
    key/value head, and the kernel `available()`."""
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    dtype = pages[0].dtype
    return (dtype in PAGE_DTYPES and all(t.dtype == dtype and t.stride(-1) == 1 for t in pages)
            and q.shape[1] // pages[0].shape[1] <= MAX_GROUPS and available())


def as_segment(segment: PagedSegment, heads: int) -> Segment:
    """The C view of `segment` (the kernel checks each request's page and read slots against its tensors' sizes)."""
    keys, values = segment.keys, segment.values
    if segment.head_scale.shape != (heads,) or segment.head_scale.dtype != torch.float32:
        raise ValueError(f"head_scale must be float32 [{heads}], got {segment.head_scale.dtype} "
                         f"{tuple(segment.head_scale.shape)}")
    visible = segment.visible
    return Segment(keys.data_ptr(), values.data_ptr(), keys.shape[0], keys.shape[2],
                   (ctypes.c_int64 * 3)(*keys.stride()[:3]), (ctypes.c_int64 * 3)(*values.stride()[:3]),
                   segment.page.data_ptr(), segment.length.data_ptr(), 0 if visible is None else visible.data_ptr(),
                   0 if visible is None else visible.stride(0), segment.head_scale.data_ptr())


def attend_segments(q: torch.Tensor, segments: list[PagedSegment]) -> torch.Tensor:
    """Each request's query q [requests, heads, dim] over its slots of every segment, one softmax, in float32:
    [requests, heads, value dim] float32. The segments' tensors are read as they lie (pages as bound by the engine,
    index tensors int64 and contiguous, masks bool with contiguous rows)."""
    library_ = library()
    batch, heads, dim = q.shape
    kv_heads, value_dim = segments[0].keys.shape[1], segments[0].values.shape[-1]
    for segment in segments:
        for index in (segment.page, segment.length):
            if index.dtype != torch.int64 or not index.is_contiguous() or index.shape != (batch,):
                raise ValueError(f"a segment's page and length must be contiguous int64 [{batch}]")
        if segment.visible is not None and (segment.visible.dtype != torch.bool or segment.visible.stride(-1) != 1):
            raise ValueError("a segment's visible mask must be bool with contiguous rows")
    queries = q.to(torch.float32).contiguous()
    out = torch.empty(batch, heads, value_dim, dtype=torch.float32)
    array = (Segment * len(segments))(*(as_segment(segment, heads) for segment in segments))
    max_read = sum(segment.keys.shape[2] for segment in segments)
    status = library_.attend_segments(queries.data_ptr(), batch, heads, kv_heads, dim, value_dim,
                                      PAGE_DTYPES[segments[0].keys.dtype], array, len(segments), max_read,
                                      torch.get_num_threads(), out.data_ptr())
    if status == 3:
        raise ValueError("a request's page or read slots lie outside the page tensors "
                         f"{[tuple(segment.keys.shape) for segment in segments]}")
    if status:
        raise RuntimeError(f"the CPU decoding attention kernel failed (status {status})")
    return out


def shifts_tokens(x: torch.Tensor, mix: torch.Tensor, carry: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether the kernel runs a step's token shift of `x` [1, tokens, width] with `mix` [width] and the carries
    `carry` [pages, width] into `output`: float32 on CPU, rows contiguous, outside compiled graphs, the kernel
    `available()`."""
    tensors = (x, mix, carry, output)
    return (not torch.compiler.is_compiling() and all(t.device.type == "cpu" and t.dtype == torch.float32
                                                      and t.stride(-1) == 1 for t in tensors)
            and mix.numel() == x.shape[-1] and available())


@dataclass
class ShiftRows:
    """Where a step's requests lie in its flat tokens, for `shift_tokens`: request r's page, the offset of its first
    token, its token count and the tokens it read before (int64, contiguous, [requests] each)."""

    page: torch.Tensor
    offset: torch.Tensor
    count: torch.Tensor
    start: torch.Tensor

    @classmethod
    def decoding(cls, page: torch.Tensor) -> ShiftRows:
        """A decoding step's: one token per request, each past its first."""
        ones = torch.ones_like(page)
        return cls(page, torch.arange(len(page), device=page.device), ones, ones)


def shift_tokens(x: torch.Tensor, mix: torch.Tensor, carry: torch.Tensor, rows: ShiftRows, first: str,
                 output: torch.Tensor) -> None:
    """A step's token shift in one call: `output[:, t] = x[:, t] + mix * (predecessor - x[:, t])` over every
    request's tokens of x [1, tokens, width] (a request's first token's predecessor its carry `carry[page]` when it
    has read tokens before, else itself, `first="first"`, or zero, `"zero"`), zeros after them, then each request's
    last token into its carry."""
    requests = rows.page.shape[0]
    for index in (rows.page, rows.offset, rows.count, rows.start):
        if index.dtype != torch.int64 or not index.is_contiguous() or index.shape != (requests,):
            raise ValueError(f"a request's page, offset, count and start must be contiguous int64 [{requests}]")
    if first not in ("first", "zero"):
        raise ValueError(f"first must be 'first' or 'zero', got {first!r}")
    mix = mix.reshape(-1)
    status = library().shift_tokens(x.data_ptr(), x.stride(1), mix.data_ptr(), carry.data_ptr(), carry.shape[0],
                                    carry.stride(0), rows.page.data_ptr(), rows.offset.data_ptr(),
                                    rows.count.data_ptr(), rows.start.data_ptr(), requests, int(first == "first"),
                                    x.shape[-1], output.data_ptr(), output.stride(1), output.shape[1])
    if status == 3:
        raise ValueError(f"a request's page lies outside the carries {tuple(carry.shape)}")
