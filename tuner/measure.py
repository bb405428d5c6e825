"""The measurement helper: what one trial's number means.

Every caller (the sweep, the re-measurement of winners, scripts) measures through
`Measurer.measure`, in this order:

1. static pruning, before any GPU time: `backend.static_reject(params, problem, arch)`
   (compile error, spills, shared memory over the device limit) and the workspace budget
   (`backend.workspace_bytes` at this batch) -> outcome `pruned` with the reason;
2. correctness gate on fresh random inputs: the output (and lse) are poisoned with NaN,
   the kernel runs, and ||o - ref|| / ||ref|| against the fp32 oracle must be < tol (NaN
   never passes) -> outcome `wrong` with the error;
3. timing with a cold L2: launches rotate over several KV pools whose total is several
   times the L2 (one pool on the CPU; see `Measurer._timing_pools`); in `graph` mode many launches are captured in one
   CUDA graph and its replays are timed with CUDA events, in `eager` mode the launches are
   timed back to back; on the CPU (`cpu-eager`) with the host clock, labelled as such;
4. median and spread (p10/p90 over repetitions) in microseconds per launch, GB/s, TFLOP/s
   and the floor `max(bytes / read_bw, flops / mma_rate)` with `% of floor` = floor/median.

Any exception is outcome `failed` with the error; a CUDA error that leaves the context
unusable is flagged `fatal` so that the worker process running it is replaced.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from kvtune.kernels import (SplitTable, VerifyInputs, get_backend, make_inputs, params_from_dict, rel_error,
                            verify_attention)
from kvtune.kernels.api import verify_attention_dispatch
from kvtune.kernels.backends import call_workspace_bytes
from kvtune.kernels.reference import reference_attention
from kvtune.kernels.shapes import VerifyProblem

OUTCOMES = ("ok", "pruned", "wrong", "failed")
TIMINGS = ("graph", "eager", "cpu-eager")


# prefixes of the second correctness check (one per request, cycled): short and odd, so the
# draft keys weigh in the softmax and tiles end mid-way
SHORT_PREFIXES = (37, 1, 97, 250)


@dataclass(frozen=True)
class ProblemSpec:
    """One measured shape: `batch` requests of `context` prefix tokens plus T drafts each, or,
    with `prefixes`, a ragged batch: request b has `prefixes[b]` prefix tokens (then `context`
    names the context bucket the batch is scored for, see `ragged_prefixes`)."""

    heads: int
    batch: int
    context: int
    draft_tokens: int
    tree: str = "chain"
    kv_lora_rank: int = 512
    rope_dim: int = 64
    sm_scale: float = 192 ** -0.5
    prefixes: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.prefixes is not None:   # a list after a JSON round trip (the trial worker's request)
            object.__setattr__(self, "prefixes", tuple(int(p) for p in self.prefixes))
            if len(self.prefixes) != self.batch or min(self.prefixes) < 0:
                raise ValueError(f"prefixes: expected {self.batch} prefix lengths >= 0, got {self.prefixes}")

    @property
    def Dk(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def ragged(self, spread: float) -> "ProblemSpec":
        """This bucket's ragged batch (`ragged_prefixes` of its batch and context at `spread`)."""
        return replace(self, prefixes=ragged_prefixes(self.batch, self.context, spread))

    @property
    def prefix_lens(self) -> list[int]:
        return list(self.prefixes) if self.prefixes is not None else [self.context] * self.batch

    @property
    def keys(self) -> int:
        """Keys of the whole batch (prefix + T per request)."""
        return sum(self.prefix_lens) + self.batch * self.draft_tokens

    def problem(self, device) -> VerifyProblem:
        return VerifyProblem(B=self.batch, T=self.draft_tokens, H=self.heads, Dk=self.Dk, Dv=self.kv_lora_rank,
                             device=torch.device(device))

    def bytes_moved(self) -> int:
        """Bytes one launch must move at least: every key row once, q, o and the indices."""
        B, T, H = self.batch, self.draft_tokens, self.heads
        return (self.keys * (2 * self.Dk + 4) + B * T * H * 2 * (self.Dk + self.kv_lora_rank)
                + 4 * (B + 1) + 8 * B * T)

    def flops(self) -> int:
        """2*T*H*(Dk+Dv) per key (QK^T and PV; the mask is not discounted)."""
        return 2 * self.draft_tokens * self.heads * (self.Dk + self.kv_lora_rank) * self.keys


#: the ragged batch a batch bucket is also scored on: its mean prefix as a share of the
#: context bucket's bound, so that the batch's total keys (what selects CUDA's NSPLIT on the
#: device) fall inside that bucket when the bucket below is at most RAGGED_MEAN of it (bucket
#: bounds at least 4/3 apart)
RAGGED_MEAN = 0.75


def ragged_prefixes(batch: int, context: int, spread: float) -> tuple[int, ...]:
    """The prefixes of the ragged batch scored for the bucket (`batch`, `context`): `batch`
    prefixes spaced geometrically over a max/min ratio of `spread` (log-uniform, deterministic),
    scaled so that their mean is RAGGED_MEAN x `context`. A serving batch mixes short and long
    requests; a bucket's NSPLIT chosen on equal requests alone can leave the longest request's
    few splits running while the other SMs idle."""
    if batch < 2 or spread <= 1:
        raise ValueError(f"ragged_prefixes: needs batch >= 2 and spread > 1, got batch={batch}, spread={spread}")
    shape = [spread ** (i / (batch - 1)) for i in range(batch)]
    scale = RAGGED_MEAN * context * batch / sum(shape)
    return tuple(max(1, round(scale * x)) for x in shape)


@dataclass(frozen=True)
class Ceilings:
    read_gbps: float
    bf16_tflops: float

    def floor_us(self, spec: ProblemSpec) -> float:
        return max(spec.bytes_moved() / (self.read_gbps * 1e3), spec.flops() / (self.bf16_tflops * 1e6))


@dataclass
class MeasureOptions:
    timing: str = "graph"             # graph | eager | cpu-eager
    reps: int = 15                    # timed repetitions (graph replays / eager batches)
    warmup: int = 2
    target_rep_us: float = 2000.0     # launches per repetition chosen to last about this long
    max_launches: int = 200
    cold_l2_factor: float = 4.0       # KV pools total >= this x L2
    max_pools: int = 64
    tol: float = 1e-2                 # ||o - ref|| / ||ref||
    workspace_budget_bytes: int = 256 << 20
    seed: int = 0
    cpu_reps: int = 3
    # serving mode: [max_keys per bucket, NSPLIT per bucket] -> launches use a SplitTable
    split_table: list | None = None
    # a per-context dispatch: the other configs' [params, [max_keys, NSPLIT per bucket]] (0 where
    # another config serves), and a third item, their backend, where it is not the measured one's;
    # launched after the measured one in every call, as serving runs them
    dispatch: list | None = None

    def __post_init__(self):
        if self.timing not in TIMINGS:
            raise ValueError(f"timing: expected one of {list(TIMINGS)}, got {self.timing!r}")


@dataclass
class Measurement:
    outcome: str
    reason: str = ""
    median_us: float | None = None
    p10_us: float | None = None
    p90_us: float | None = None
    rel_err: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    floor_us: float | None = None
    pct_floor: float | None = None
    timing: str = ""
    launches: int | None = None
    pools: int | None = None
    wall_s: float = 0.0
    fatal: bool = False
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _sizes(*nbytes: int) -> list[str]:
    """Byte counts in MiB, or in bytes where MiB would round one under 1 MiB (a budget of 0.001 MiB
    read "0 MiB") or make two read the same."""
    mib = [f"{n / 2**20:.1f} MiB" for n in nbytes]
    if min(nbytes) < 2**20 or len(set(mib)) < len(mib):
        return [f"{n} bytes" for n in nbytes]
    return mib


def _fmt_exc(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:400]}"


def _cuda_context_dead() -> str | None:
    """After an exception on the GPU: the sticky CUDA error, if the context is poisoned."""
    try:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return _fmt_exc(e)
    return None


def _is_resource_error(e: BaseException) -> bool:
    """A compile-time impossibility (shared memory / registers over the limit)."""
    name = type(e).__name__
    return name in ("OutOfResources",) or "out of resource" in str(e).lower()


class Measurer:
    """Measures configs on one device; keeps the inputs of the last shape for reuse across
    trials (timing pools are allocated once per shape; values are refreshed per check)."""

    def __init__(self, device: str = "cuda", arch: str | None = None, l2_bytes: int | None = None):
        self.device = torch.device(device)
        self.arch = arch
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            self.l2_bytes = l2_bytes or int(getattr(props, "L2_cache_size", 0) or 64 << 20)
            if self.arch is None:
                self.arch = f"sm_{props.major}{props.minor}"
        else:
            self.l2_bytes = 0
        self._key = None
        self._check = None
        self._pools: list = []
        self._gen = None
        self._short_seed = 0

    # -- inputs ---------------------------------------------------------------------------
    def _inputs_for(self, spec: ProblemSpec, opts: MeasureOptions):
        key = (spec, opts.cold_l2_factor, opts.max_pools)
        if key == self._key:
            return
        self._check = self._pools = None
        self._key = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        mk = dict(tree=spec.tree, kv_lora_rank=spec.kv_lora_rank, rope_dim=spec.rope_dim, device=self.device,
                  sm_scale=spec.sm_scale)
        # values on the device: the check refreshes them before every use anyway, and drawing a
        # large batch's pool on the host was most of a sweep's time (45 s at 64 x 128k)
        self._check = make_inputs(spec.batch, spec.draft_tokens, spec.heads, spec.prefix_lens, seed=opts.seed,
                                  device_values=True, **mk)
        self._gen = torch.Generator(device=self.device).manual_seed(opts.seed + 7919)
        self._pools = self._timing_pools(spec, opts)
        self._key = key

    def _timing_pools(self, spec: ProblemSpec, opts: MeasureOptions, regions: bool | None = None) -> list:
        """KV pools for timing: on the GPU, n disjoint regions of one random bf16 tensor (n
        regions of 1.25x the keys a launch reads, together >= cold_l2_factor x L2, at least
        two), each request's slots a random permutation within its region; q, indptr and the
        tree are the check's. On the CPU, the check's inputs (one pool)."""
        chk = self._check
        if not (self.device.type == "cuda" if regions is None else regions):
            return [chk]
        used = int(chk.kv_indptr[-1])
        region = max(used + 1, int(used * 1.25))
        n = max(2, min(opts.max_pools, math.ceil(opts.cold_l2_factor * self.l2_bytes / (region * spec.Dk * 2))))
        gen = self._gen
        kv = torch.empty(n * region, spec.Dk, dtype=torch.bfloat16, device=self.device)
        kv.normal_(generator=gen)
        pools = []
        for i in range(n):
            idx = torch.randperm(region, device=self.device, generator=gen)[:used] + i * region
            pools.append(VerifyInputs(q=chk.q, kv_cache=kv, kv_indptr=chk.kv_indptr,
                                      kv_indices=idx.to(chk.kv_indices.dtype), tree_mask=chk.tree_mask,
                                      sm_scale=chk.sm_scale, prefix_lens=chk.prefix_lens, parents=chk.parents,
                                      kv_lora_rank=chk.kv_lora_rank))
        return pools

    def _refresh_check(self):
        """Fresh random values for the correctness check (same structure, new q and KV)."""
        inp = self._check
        inp.q.normal_(generator=self._gen)
        inp.kv_cache.normal_(generator=self._gen)

    # -- the one entry point --------------------------------------------------------------
    def measure(self, backend: str, params: dict | None, spec: ProblemSpec, opts: MeasureOptions,
                ceilings: Ceilings | None) -> Measurement:
        t0 = time.perf_counter()
        timing = "cpu-eager" if self.device.type != "cuda" else opts.timing
        res = self._measure(backend, params, spec, opts, ceilings, timing)
        res.timing = timing
        res.wall_s = time.perf_counter() - t0
        if ceilings is not None:
            res.floor_us = ceilings.floor_us(spec)
            if res.median_us:
                res.pct_floor = 100.0 * res.floor_us / res.median_us
        return res

    def _measure(self, backend, params, spec, opts, ceilings, timing) -> Measurement:
        be = get_backend(backend)
        problem = spec.problem(self.device)
        why = be.supports(self.device)
        if why:
            return Measurement("failed", f"backend {backend} cannot run on {self.device}: {why}")
        # -- 1. static pruning (no GPU time)
        try:
            p = be.default_params(problem) if params is None else \
                params_from_dict(be.params_type, dict(params), where=f"{backend} params")
            why = be.static_reject(p, problem, self.arch)
            others = []
            for d in opts.dispatch or []:
                obe = get_backend(d[2]) if len(d) > 2 else be
                why = why or obe.supports(self.device)
                others.append((params_from_dict(obe.params_type, dict(d[0]), where=f"{obe.name} dispatch params"),
                               SplitTable.build(*d[1], self.device), obe))
            why = why or next((w for w in (o[2].static_reject(o[0], problem, self.arch) for o in others) if w), None)
        except ValueError as e:
            return Measurement("pruned", str(e))
        if why:
            return Measurement("pruned", why)
        ws_bytes = call_workspace_bytes(problem, [(p, be), *((o[0], o[2]) for o in others)])
        if ws_bytes > opts.workspace_budget_bytes:
            ws, budget = _sizes(ws_bytes, opts.workspace_budget_bytes)
            return Measurement("pruned", f"workspace {ws} at batch {spec.batch} exceeds the budget of {budget}")
        try:
            return self._run(be, p, spec, opts, timing, ws_bytes, others)
        except Exception as e:  # noqa: BLE001 - every failure is a recorded outcome
            if self.device.type == "cuda":
                dead = _cuda_context_dead()
                if dead:
                    return Measurement("failed", f"CUDA error: {_fmt_exc(e)}", fatal=True)
            if _is_resource_error(e):
                return Measurement("pruned", f"compile: {_fmt_exc(e)}")
            return Measurement("failed", _fmt_exc(e))

    def _run(self, be, p, spec, opts, timing, ws_bytes, others=()) -> Measurement:
        self._inputs_for(spec, opts)
        dev = self.device
        rows, H, Dv = spec.batch * spec.draft_tokens, spec.heads, spec.kv_lora_rank
        ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=dev)
        out = torch.empty(rows, H, Dv, dtype=torch.bfloat16, device=dev)
        st = SplitTable.build(list(opts.split_table[0]), list(opts.split_table[1]), dev) if opts.split_table else None
        launches = [(p, st, be), *others]

        def launch(inp, lse=None):   # as the runtime's run launches them (one chain where it can)
            if len(launches) == 1:
                verify_attention(*inp.args, backend=be, params=p, out=out, lse=lse, workspace=ws,
                                 kv_lora_rank=spec.kv_lora_rank, check_values_=False, split_table=st)
            else:
                verify_attention_dispatch(*inp.args, [(b, c, t) for c, t, b in launches], out, lse=lse,
                                          workspace=ws, kv_lora_rank=spec.kv_lora_rank, check_values_=False)

        # -- 2. correctness gate: fresh values, poisoned outputs, fp32 oracle
        self._refresh_check()
        chk = self._check
        out.fill_(float("nan"))
        lse = torch.full((rows, H), float("nan"), dtype=torch.float32, device=dev)
        launch(chk, lse)
        ref_o, ref_lse = reference_attention(*chk.args, kv_lora_rank=spec.kv_lora_rank)
        err = rel_error(out, ref_o)
        if not err < opts.tol:
            return Measurement("wrong", f"||o-ref||/||ref|| = {err:.3g} >= {opts.tol:g}", rel_err=err)
        fin = torch.isfinite(ref_lse)
        lse_bad = bool((torch.isfinite(lse) != fin).any()) or \
            bool(((lse - ref_lse).abs()[fin] > 1e-2 * (1 + ref_lse.abs()[fin])).any())
        if lse_bad:
            return Measurement("wrong", "lse differs from the oracle's (or is NaN)", rel_err=err)
        # -- 2b. the same gate at short ragged prefixes: at 4k+ prefix keys the T draft keys
        #    carry so little softmax mass that a wrong tree mask moves o by < 1e-2 and passes
        self._short_seed += 1
        short = make_inputs(spec.batch, spec.draft_tokens, spec.heads,
                            [min(spec.context, SHORT_PREFIXES[b % len(SHORT_PREFIXES)]) for b in range(spec.batch)],
                            tree=spec.tree, kv_lora_rank=spec.kv_lora_rank, rope_dim=spec.rope_dim, device=dev,
                            sm_scale=spec.sm_scale, seed=opts.seed + self._short_seed)
        out.fill_(float("nan"))
        launch(short)
        err_short = rel_error(out, reference_attention(*short.args, kv_lora_rank=spec.kv_lora_rank)[0])
        if not err_short < opts.tol:
            return Measurement("wrong", f"at short prefixes {short.prefix_lens}: ||o-ref||/||ref|| = "
                                        f"{err_short:.3g} >= {opts.tol:g}", rel_err=err_short)
        err = max(err, err_short)
        # -- 3. timing over rotating KV pools (cold L2)
        pools = self._pools
        if timing == "cpu-eager":
            times = []
            if opts.warmup:
                launch(pools[0])
            for r in range(opts.cpu_reps):
                t = time.perf_counter()
                launch(pools[r % len(pools)])
                times.append((time.perf_counter() - t) * 1e6)
            n_launch = 1
        else:
            times, n_launch = self._time_cuda(launch, pools, opts, timing)
        times.sort()
        med = _quantile(times, 0.5)
        res = Measurement("ok", "", median_us=med, p10_us=_quantile(times, 0.1), p90_us=_quantile(times, 0.9),
                          rel_err=err, launches=n_launch, pools=len(pools))
        res.gbps = spec.bytes_moved() / (med * 1e3)
        res.tflops = spec.flops() / (med * 1e6)
        return res

    def _time_cuda(self, launch, pools, opts, timing):
        np_ = len(pools)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (compiles) outside capture
            for i in range(max(opts.warmup, 1) * np_):
                launch(pools[i % np_])
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        # estimate one launch to size a repetition
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(np_):
            launch(pools[i % np_])
        e.record()
        torch.cuda.synchronize()
        est_us = max(1.0, s.elapsed_time(e) * 1e3 / np_)
        n = int(min(opts.max_launches, max(np_, opts.target_rep_us / est_us)))
        n = max(np_, (n // np_) * np_)
        times = []
        if timing == "graph":
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(n):
                    launch(pools[i % np_])
            g.replay()
            torch.cuda.synchronize()
            for _ in range(opts.reps):
                s.record()
                g.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) * 1e3 / n)
            del g
        else:
            for _ in range(opts.reps):
                s.record()
                for i in range(n):
                    launch(pools[i % np_])
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) * 1e3 / n)
        return times, n


def _quantile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    x = q * (len(sorted_vals) - 1)
    lo = int(math.floor(x))
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (x - lo)


def warm(backend: str, params: dict, spec: ProblemSpec, device: str, arch: str | None = None) -> str:
    """Compile `params` for `spec`'s compile-time shape (same B, T, H; a short context) so
    that the measuring process finds it in the backends' on-disk caches: the static check
    (which compiles, for the CUDA backend) and one launch on small inputs. Returns what
    happened, for logs; any failure is left for the real measurement to record."""
    be = get_backend(backend)
    small = replace(spec, context=min(spec.context, 64), prefixes=None)
    problem = small.problem(device)
    p = params_from_dict(be.params_type, dict(params), where=f"{backend} params")
    why = be.static_reject(p, problem, arch)
    if why:
        return f"rejected: {why}"
    inp = make_inputs(small.batch, small.draft_tokens, small.heads, small.context, tree=small.tree,
                      kv_lora_rank=small.kv_lora_rank, rope_dim=small.rope_dim, device=device, seed=0,
                      sm_scale=small.sm_scale)
    try:
        verify_attention(*inp.args, backend=be, params=p, kv_lora_rank=small.kv_lora_rank, check_values_=False)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
    except Exception:
        if torch.device(device).type == "cuda" and _cuda_context_dead():
            import os
            os._exit(70)          # a poisoned context: let the pool replace this process
        raise
    return "compiled"
