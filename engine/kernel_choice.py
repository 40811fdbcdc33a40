"""Which GEMM a quantized projection runs, by the rows of the call, chosen from measurements.

torch's weight-only int4 / int8 CPU kernels read 4 or 8 bits a weight, so they are the fastest while
a GEMM is bound by memory (a decode step of a few sequences), but they compute at about 300 GFLOP/s
at any row count, where oneDNN's packed bfloat16 kernel reaches 650 at 32 rows and 900-1000 from
128. So with 16-bit activations each quantized projection (and a tied LM head) also gets a packed
copy of its dequantized matrix, and calls of packed_from rows or more take it (engine/load/quant.py,
QuantizedLinear).

packed_from comes from measurement: engine/load/prepack.py's QUANTIZED_PACKED_FROM_ROWS for the CPU
kinds and thread counts measured (`python bench/quantized.py --gemm`), else a calibration at load on
the model's own matrices, timed as a forward meets them (every layer in turn, so cold in cache). A
copy costs 2 bytes a weight: it is made only while all copies together stay within PLAIN_MAX_BYTES,
so a large model keeps its quantized size (and torch's int kernels at every row count).

The choice makes a row's arithmetic depend on the step's row count (docs/determinism.md): the two
kernels round differently. So where one int4 kernel is about as fast at every row count (AMX CPUs:
the AMX kernel; AVX512_BF16 CPUs without AMX: the AVX-512 BF16 int4 kernel, where a timing at load
finds it within AVX512_INVARIANT_RATIO of the copies on prompts) the int4 matrices take it at every
row count instead (invariant_by_default, attach_tiles). Elsewhere on AVX512_BF16 CPUs that kernel
and, for the int8 head, the int8 AMX kernel's rows path replace torch's kernels below the threshold,
calibrated against them.
With float32 activations on AVX2 CPUs the int4 matrices carry the AVX2 kernel's codes and take
float32 copies from rows calibrated at load against it (attach_float32_copies).
docs/performance.md, "Quantized weights by row count", has the figures and that caveat.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from engine.kernel_calibration import (
    AVX512_CALIBRATION_ROWS,
    AVX512_INVARIANT_RATIO,
    CALIBRATION_MATRICES,
    INT8_CALIBRATION_ROWS,
    NEVER,
    PROMPT_ROWS,
    calibrate,
    prompt_ratio,
)
from engine.load import amx, int4_avx512
from engine.load.dtype import cpu_kind
from engine.load.prepack import (
    PLAIN_MAX_BYTES,
    QUANTIZED_TILES_ROWS,
    PackedLinear,
    plain_from_rows,
    quantized_packed_from,
    same_bits_rows,
)
from engine.load.quant import Int4Linear, Int8Linear, QuantizedLinear

log = logging.getLogger("conveyor.kernel_choice")
# CPU kinds whose quantized default can be batch-invariant (invariant_by_default): on AVX512_BF16
# where its int4 kernel keeps up with the packed copies on prompts, timed at load.
INVARIANT_KINDS = frozenset({"AMX", "AVX512_BF16"})


def kind_of(module: QuantizedLinear) -> str:
    return "int4" if isinstance(module, Int4Linear) else "int8"


def switched_modules(model: nn.Module) -> list[QuantizedLinear]:
    """The quantized matrices that multiply: every QuantizedLinear but an embedding that is not
    also the (tied) LM head, whose rows are only looked up."""
    embed = model.model.embed_tokens  # type: ignore[union-attr]
    tied = getattr(model, "lm_head", None) is None
    return [m for m in model.modules()
            if isinstance(m, QuantizedLinear) and (m is not embed or tied)]


def attach_packed_copies(model: nn.Module, dtype: torch.dtype, kind: str | None = None,
                         deterministic: bool = False) -> dict[str, int]:
    """Gives the model's quantized matrices their packed copies and thresholds. -> int4 / int8 ->
    the rows from which that kernel hands over ({} when no copy was made). kind: the CPU kind
    (tests). deterministic: the copies at every row count (one kernel: a row's arithmetic does not
    depend on the step's rows), one-row calls padded, on AMX CPUs cut into ONEDNN_SAME_BITS_ROWS."""
    modules = switched_modules(model)
    if dtype == torch.float32 and any(avx2_coded(m) for m in modules):
        return attach_float32_copies(modules, deterministic)
    kind = kind or cpu_kind()
    if not deterministic and invariant_by_default(modules, dtype, kind):
        deterministic = True
        log.info("quantized GEMMs in one arithmetic at every row count (invariant by default on %s "
                 "CPUs: docs/determinism.md)", kind)
    without_copies, int4_handover = attach_tiles(modules, deterministic, kind)
    modules = [m for m in modules if id(m) not in without_copies]
    size = sum(m.shape()[0] * m.shape()[1] for m in modules) * torch.finfo(dtype).bits // 8
    if not modules or dtype != torch.bfloat16 or size > PLAIN_MAX_BYTES:
        if modules and dtype == torch.bfloat16:
            log.info("no packed copies of the quantized matrices: they would take %.0f MiB",
                     size / 2**20)
        return {}
    cut = same_bits_rows(deterministic, kind)
    for m in modules:
        m.packed = PackedLinear(m.dequantized(), None, pad_one_row=deterministic, max_rows=cut)
        m.packed_from = NEVER
    if deterministic:
        for m in modules:
            m.packed_from = 1
        log.info("--deterministic: quantized GEMMs on their packed %s copies at every row count",
                 str(dtype).removeprefix("torch."))
        return {k: 1 for k in {kind_of(m) for m in modules}}
    table, measured = handover_rows(modules, kind, int4_handover)
    for m in modules:
        m.packed_from = table.get(kind_of(m), NEVER)
        if m.packed_from >= NEVER:
            m.packed = None  # the int kernel won at every row count tried: no copy
    chosen = {k: v for k, v in table.items() if v < NEVER}
    log.info("quantized GEMMs hand over to packed %s copies (%.0f MiB) from %s rows (measured at "
             "load: %s; else the table for %s at %d threads)", str(dtype).removeprefix("torch."),
             size / 2**20, chosen, sorted(measured) or "none", kind, torch.get_num_threads())
    return chosen


def handover_rows(modules: Sequence[QuantizedLinear], kind: str,
                  int4_handover: int | None) -> tuple[dict[str, int], set[str]]:
    """int4 / int8 -> the rows from which the modules with copies take them, and which of those
    were calibrated here: the table for this CPU kind and thread count where it holds, else a
    calibration. The table timed torch's int kernels, so matrices on the AVX-512 BF16 int4 kernel
    or the int8 rows path below the threshold are always calibrated (against it: chain_times)."""
    table = dict(quantized_packed_from(kind, torch.get_num_threads()) or {})
    if int4_handover is not None:
        table["int4"] = int4_handover
    avx512 = [m for m in modules if isinstance(m, Int4Linear) and m.tiles_avx512]
    if avx512:
        rows = AVX512_CALIBRATION_ROWS
        table["int4"] = min(calibrate(avx512, rows), rows[-1])
    rows_path = [m for m in modules if isinstance(m, Int8Linear) and m.tiles_avx512]
    if rows_path:
        table["int8"] = calibrate(rows_path, INT8_CALIBRATION_ROWS)
    measured = {kind_of(m) for m in modules} - table.keys()
    for k in measured:
        table[k] = calibrate([m for m in modules if kind_of(m) == k])
    return table, measured | ({"int4"} if avx512 else set()) | ({"int8"} if rows_path else set())


def invariant_by_default(modules: Sequence[QuantizedLinear], dtype: torch.dtype,
                         kind: str) -> bool:
    """Whether the quantized GEMMs take --deterministic's kernels without the flag: where that
    costs under 5% of served throughput (issue #30). On AMX CPUs every int4 matrix with tile codes
    runs the AMX kernel's arithmetic at every row count, and the int8 head the int8 AMX kernel's,
    at about the switching kernels' speed or faster (docs/determinism.md). On AVX512_BF16 CPUs the
    AVX-512 BF16 int4 kernel, where it is timed here within AVX512_INVARIANT_RATIO of the copies."""
    int4 = [m for m in modules if isinstance(m, Int4Linear)]
    runs = amx.usable() if kind == "AMX" else int4_avx512.usable()
    if not (kind in INVARIANT_KINDS and dtype == torch.bfloat16 and bool(int4)
            and all(m.tile_codes is not None for m in int4) and runs):
        return False
    if kind == "AMX":
        return True
    ratio = prompt_ratio(int4)
    log.info("the AVX-512 BF16 int4 kernel takes %.2fx the packed copies' time at %d rows: %s",
             ratio, PROMPT_ROWS, "at every row count" if ratio <= AVX512_INVARIANT_RATIO
             else "below a calibrated handover to them")
    return ratio <= AVX512_INVARIANT_RATIO


def attach_tiles(modules: Sequence[QuantizedLinear], deterministic: bool,
                 kind: str = "AMX") -> tuple[set[int], int | None]:
    """Sets the rows from which int4 matrices with AMX codes take the AMX kernel (on AVX512_BF16
    CPUs its AVX-512 BF16 sibling, from one row). -> (ids of the modules that need no packed copy,
    the rows from which the others of their kind hand over to one: None where the table or a
    calibration decides). Deterministic: that kernel at every row count, no copy; the int8 head on
    its own kernel too (attach_int8_tiles)."""
    tiled = [m for m in modules if isinstance(m, Int4Linear) and m.tile_codes is not None]
    if kind == "AVX512_BF16":  # the int8 head on the rows path: below its copy's rows by default
        rows_path = attach_int8_tiles(modules, avx512=True, everywhere=deterministic)
        int8 = rows_path if deterministic else set()
        if not tiled or not int4_avx512.usable():
            return int8, None
        for m in tiled:  # in place of torch's int4 kernel; the copies take over from a calibration
            m.tiles_avx512, m.amx_from = True, 1
        log.info("int4 GEMMs on the AVX-512 BF16 kernel %s",
                 "at every row count" if deterministic else "below their packed copies' rows")
        return ({id(m) for m in tiled} | int8 if deterministic else int8), None
    if kind != "AMX":
        return set(), None
    int8 = attach_int8_tiles(modules) if deterministic else set()
    rows = QUANTIZED_TILES_ROWS.get(torch.get_num_threads())
    if not tiled or (rows is None and not deterministic):
        return int8, None
    amx_from, handover = (1, NEVER) if deterministic or rows is None else rows
    for m in tiled:
        m.amx_from = amx_from
    log.info("int4 GEMMs on AMX tiles from %d rows%s", amx_from,
             "" if handover >= NEVER else f", on packed copies from {handover}")
    return ({id(m) for m in tiled} | int8, None) if handover >= NEVER else (int8, handover)


def attach_int8_tiles(modules: Sequence[QuantizedLinear], avx512: bool = False,
                      everywhere: bool = True) -> set[int]:
    """int8 matrices (the tied head) on the int8 AMX kernel, reading 1 byte a weight where a padded
    copy read 2 (docs/kernels.md, "The int8 GEMM on AMX tiles"): everywhere (deterministic, the AMX
    default), at every row count with no copy; else below their copies' rows. avx512 (AVX-512 BF16,
    no AMX): on that kernel's rows path, the tiles' bits. -> their ids."""
    tiled = [m for m in modules if isinstance(m, Int8Linear) and m.make_tiles(avx512)]
    for m in tiled:
        m.amx_from = 1
    if tiled:
        log.info("int8 GEMMs on %s %s", "the AMX kernel's rows path" if avx512 else "AMX tiles",
                 "at every row count" if everywhere else "below their packed copies' rows")
    return {id(m) for m in tiled}


def attach_int8_avx2(model: nn.Module, dtype: torch.dtype,
                     deterministic: bool = False) -> int | None:
    """Float32 int8 matrices (the tied head) on the int8 AVX2 kernel (engine/load/int8_avx2.py:
    torch's int8 kernel is scalar with float32 activations) below the rows from which their float32
    packed copy (attach_packed_copies) takes over, calibrated here; NEVER where the kernel wins to
    INT8_CALIBRATION_ROWS' last, or there is no copy, or deterministic (the kernel's
    arithmetic does not depend on the rows; the copy's differs): then the copy is dropped. The
    codes' [N, K] layout goes too: only the kernel's is kept. Called after attach_packed_copies.
    -> that row count; None where no matrix takes the kernel."""
    if dtype != torch.float32:
        return None
    mats = [m for m in switched_modules(model) if isinstance(m, Int8Linear) and m.make_avx2()]
    copies = [m for m in mats if m.packed is not None]
    handover = calibrate(copies, INT8_CALIBRATION_ROWS) if copies and not deterministic \
        else NEVER
    for m in mats:
        m.amx_from, m.packed_from = 1, handover
        if handover >= NEVER:
            m.packed = None
        m.keep_avx2_codes_only()  # torch's int8 kernel never runs now
    if mats:
        log.info("int8 GEMMs with float32 activations on the AVX2 kernel%s", " at every row count"
                 if handover >= NEVER else f", on packed copies from {handover} rows (calibrated)")
    return handover if mats else None


def avx2_coded(m: QuantizedLinear) -> bool:
    """Whether m is an int4 matrix with the AVX2 kernel's codes (float32 activations)."""
    return isinstance(m, Int4Linear) and m.avx2_scale_low is not None


def attach_float32_copies(modules: Sequence[QuantizedLinear],
                          deterministic: bool) -> dict[str, int]:
    """Float32 activations where the int4 matrices carry the AVX2 kernel's codes
    (engine/load/int4_avx2.py): they take it below a row count calibrated here against packed
    float32 copies (MKL's plain matrix from plain_from_rows), 128 at the latest: the two tie at 128
    rows, so a calibration alone flipped between reloads, and the copies are 1.16x faster on
    512-row prompts (docs/kernels.md). The others (the int8 head) take their copy at every row
    count (then attach_int8_avx2). Under w4a8, and deterministic, the kernel at every row count
    (w4a8's beat the copies at 1..512 rows); deterministic pads the others' one-row calls. No
    copies beyond PLAIN_MAX_BYTES. -> int4 / int8 -> the rows from which each takes its copy."""
    coded = [m for m in modules if avx2_coded(m)]
    rest = [m for m in modules if not avx2_coded(m)]
    # w4a8's kernel beats the copies at every row count measured (1..512): no copies for them
    rounded = any(isinstance(m, Int4Linear) and m.avx2_q8 for m in coded)
    copied = rest if deterministic or rounded else list(modules)
    size = sum(m.shape()[0] * m.shape()[1] for m in copied) * 4
    if size > PLAIN_MAX_BYTES:
        log.info("int4 GEMMs on the AVX2 kernel at every row count; no packed float32 copies: they "
                 "would take %.0f MiB", size / 2**20)
        return {}
    plain_from = None if deterministic else plain_from_rows(torch.float32)
    for m in copied:
        m.packed = PackedLinear(m.dequantized(), None, plain_from, pad_one_row=deterministic)
        m.packed_from = 1
    chosen = {kind_of(m): 1 for m in rest}
    rows = AVX512_CALIBRATION_ROWS  # the last, 128, is the cap: a tie there must not decide
    handover = (NEVER if deterministic or rounded
                else min(calibrate(coded[:CALIBRATION_MATRICES], rows[:-1]), rows[-1]))
    for m in coded:  # the kernel from one row: its mm fuses the residual
        m.packed_from, m.amx_from = handover, 1
        if handover >= NEVER:
            m.packed = None  # the kernel won at every row count tried: no copy
    if handover < NEVER:
        chosen["int4"] = handover
    log.info("int4 GEMMs on the AVX2 kernel %s; packed float32 copies (%.0f MiB) from %s rows",
             "at every row count" if handover >= NEVER
             else f"below {handover} rows (measured at load)",
             sum(m.shape()[0] * m.shape()[1] for m in modules if m.packed is not None) * 4 / 2**20,
             chosen)
    return chosen
