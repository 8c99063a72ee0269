"""The DDTree steps on the GPU (SPEC section 3) for :class:`kdt.engine.cuda_model.CudaModel`.

Two ways to run a step, same results:

- :class:`CudaTreeOps`: the step as separate calls from the decode loop (tree build, verify, target
  choice, accept, with the host reading the node count, the choices and the accepted path). Any
  drafter, greedy or sampled.
- :class:`StepGraph`: a whole greedy step as one program on the device, replayed from one CUDA graph
  per (budget, depth, K): [the learned drafter's block and its top-k, or the noiseless oracle's draft from its
  sequence (:class:`DeviceOracle`)] -> tree build -> stage ->
  target forward -> argmax -> accept -> KV compaction -> [the accepted nodes' features as the drafter's
  next context rows, and its next step's rows staged] -> commit (L += 1 + a, the bonus becomes the root).
  The drafter runs once per step: the previous step's context rows and this step's block in one forward
  of 2B rows (the first step's rows are staged by ``start``). The host
  writes a host drafter's draft into host memory mapped into the device (no copy call) before the
  launch; after it, the host waits on an event behind the program (the step's only synchronisation)
  and reads one record that the program wrote into mapped host memory: ``[1 + a, the committed tokens]``.
  A step that drafts on the device (or an AR step) needs nothing from the host, so the decode loop
  launches it before reading its predecessor's record (``launch`` / ``result``; two record rows in
  turn): the GPU never waits for the host between steps. A step launched ahead of one that ended the
  generation (a stop token) is dropped (``discard``: the device state goes back to the last step read).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
from numba import cuda

from kdt.engine.cuda_model import CudaDraftModel, CudaModel, DeviceLogits, ForwardGraphs
from kdt.kernels import ddtree as kd
from kdt.kernels import elementwise as ew
from kdt.kernels.common import IS_SIM, cdiv
from kdt.reference.decode import TreeOps


@dataclass
class GpuTree:
    """A tree built on the GPU, left there: its arrays are request 0 of ``bufs`` (kernel outputs); the
    host knows only the node count. Node 0 is the root."""

    bufs: kd.TreeBuffers
    n: int


def stage_tree(tree: kd.TreeBuffers, n: int, model: CudaModel, stream=0) -> None:
    """The first ``n`` nodes of request 0 of ``tree`` into the model's forward inputs (tokens,
    positions, the [n, n] visibility block), on the device."""
    b = model.buf
    kd.stage_tree[max(1, cdiv(n * n, kd.STAGE_THREADS)), kd.STAGE_THREADS, stream](
        tree.tokens, tree.positions, tree.visibility, tree.n_nodes, np.int32(0), b.tokens, b.positions, b.vis)
    b.vis_host = None  # b.vis now holds the tree's mask


class CudaTreeOps(TreeOps):
    """DDTree steps with the GPU kernels, the tree never leaving the device: tree_build into persistent
    buffers, stage_tree into the forward's inputs, argmax, tree_accept on the device choice. Per step
    the host writes the draft into mapped memory and reads back the node count, the choices and the
    accepted path. ``device_step(drafter)`` gives the one-program step (:class:`StepGraph`)."""

    def __init__(self, model: CudaModel):
        self.model = model
        b = model.buf
        self.nmax = min(b.M_max, kd.MAX_BUDGET + 1)
        self.tree = kd.alloc_tree(1, self.nmax)
        self.root = cuda.device_array(1, np.int64)
        self.acc = kd.AcceptBuffers(cuda.device_array((1, self.nmax), np.int32), cuda.device_array(1, np.int32),
                                    cuda.device_array(1, np.int64))
        self._draft: dict[tuple[int, int, bool], tuple] = {}  # (D, K, mapped) -> draft tokens, logp
        self._choice_on_device = False  # the last choose() left its choices in buf.choice (greedy argmax)
        self._steps: dict[tuple, StepGraph] = {}

    def draft_buffers(self, D: int, K: int, mapped: bool = False) -> tuple:
        """Persistent draft arrays [1, D, K] (int64 tokens, float32 log-probs): device memory for the
        device drafter's top-k, or host memory mapped into the device (``mapped``) for host drafts:
        the host writes them and the tree kernel reads them straight over PCIe, no copy call (numba's
        two small copies cost ~0.4 ms of host time per step on the H200)."""
        if (D, K, mapped) not in self._draft:
            alloc = cuda.mapped_array if mapped else cuda.device_array
            self._draft[D, K, mapped] = (alloc((1, D, K), np.int64), alloc((1, D, K), np.float32))
        return self._draft[D, K, mapped]

    def upload_draft(self, draft_tokens, draft_logp) -> tuple:
        """A host draft [D, K] into the mapped draft arrays (safe: the previous step has finished)."""
        d_tok, d_logp = self.draft_buffers(*np.shape(draft_tokens), mapped=True)
        d_tok[0] = draft_tokens
        d_logp[0] = draft_logp
        return d_tok, d_logp

    def check_budget(self, budget: int) -> None:
        if budget + 1 > self.nmax:
            raise ValueError(f"a tree of budget {budget} needs {budget + 1} nodes; this model verifies at most "
                             f"{self.nmax} tokens per forward (max_tokens)")

    def build(self, root, draft_tokens, draft_logp, budget, L):
        self.check_budget(budget)
        d_tok, d_logp = self.upload_draft(draft_tokens, draft_logp)
        self.root.copy_to_device(np.array([root], np.int64))
        b = self.model.buf
        b.L.copy_to_device(np.array([L], np.int64))
        kd.build_tree_gpu(self.root, d_tok, d_logp, int(budget), b.L, out=self.tree)
        return GpuTree(self.tree, int(self.tree.n_nodes.copy_to_host()[0]))

    def verify(self, target, tree, L, hidden_layers=()):
        if not isinstance(tree, GpuTree):
            return super().verify(target, tree, L, hidden_layers)
        m = self.model
        if hidden_layers:
            m.set_feature_layers(tuple(hidden_layers))
        stage_tree(tree.bufs, tree.n, m)
        m._run(tree.n)
        logits = DeviceLogits(m.buf.logits[: tree.n])
        return (logits, m.hidden_rows(tree.n)) if hidden_layers else logits

    def choose(self, logits, temperature, rng):
        self._choice_on_device = temperature == 0 and isinstance(logits, DeviceLogits)
        if not self._choice_on_device:  # sampling (or host logits): the choices are made on the host
            return super().choose(np.asarray(logits), temperature, rng)
        M = logits.shape[0]
        out = self.model.buf.choice[:M]
        ew.argmax_rows(logits.device, out, scratch=self.model.buf.argmax)
        return out.copy_to_host()

    def accept(self, tree, choice):
        if not isinstance(tree, GpuTree):
            return super().accept(tree, choice)
        t, n = tree.bufs, tree.n
        if n > 1:
            b = self.model.buf
            if not self._choice_on_device:  # host-made choices (sampling): upload them
                b.choice[:n].copy_to_device(np.ascontiguousarray(choice, np.int64)[:n])
            ch = b.choice[: self.nmax].reshape(1, self.nmax)
            kd.accept_gpu(t.first_child, t.next_sibling, t.tokens, ch, t.n_nodes, out=self.acc)
            row = self.acc.accepted[0].copy_to_host()  # the path, padded with -1: one copy
            accepted = row[row >= 0].astype(np.int64)
        else:
            accepted = np.zeros(1, np.int64)
        return accepted, int(np.asarray(choice)[accepted[-1]])

    def device_step(self, drafter) -> StepGraph | None:
        """The one-program greedy step for ``drafter`` (None: autoregressive), cached per drafter and the
        target's recorded feature layers (the captured programs depend on both). None for a drafter that
        reads target features but cannot draft inside the program (its context is fed by the host)."""
        on_device = drafts_on_device(drafter, self.model)
        if getattr(drafter, "feature_layers", None) and not on_device:
            return None
        draft_model = drafter.model if on_device else None
        oracle = getattr(drafter, "on_device", False) and not on_device  # the noiseless oracle's kernel
        key = ("oracle" if oracle else id(draft_model), self.model.feature_layers)
        step = self._steps.get(key)
        if step is None or step.draft_model is not draft_model:
            step = self._steps[key] = StepGraph(self, draft_model, DeviceOracle(self.model) if oracle else None)
        step.drafter = drafter
        return step


class DeviceOracle:
    """The noiseless oracle drafting inside the step program (:class:`kdt.drafters.OracleDrafter` with
    ``on_device``): its sequence padded past the known continuation, and its column offsets and log-probabilities
    per (D, K), in device buffers that the captured graphs keep; ``load(drafter)`` refills them for a new one."""

    def __init__(self, model: CudaModel):
        self.V = model.cfg.vocab_size
        self.sequence = cuda.device_array(model.max_len + kd.ORACLE_PAD, np.int64)  # [max_len + pad]
        self.tables: dict[tuple[int, int], tuple] = {}  # (D, K) -> cols [D, K] int64, logp [D, K] float32
        self.drafter = None

    def load(self, drafter) -> None:
        self.drafter = drafter
        self.sequence.copy_to_device(drafter.padded(self.sequence.shape[0]))
        for (D, K), (cols, logp) in self.tables.items():
            c, lp = drafter.tables(D, K)
            cols.copy_to_device(np.ascontiguousarray(c))
            logp.copy_to_device(np.ascontiguousarray(lp))

    def program(self, L, d_tok, d_logp, stream=0) -> None:
        """The draft at the device's prefix ``L`` [1] into d_tok / d_logp [1, D, K] (a step program's part)."""
        _, D, K = d_tok.shape
        if (D, K) not in self.tables:  # (first met in a direct run, before any capture)
            self.tables[D, K] = tuple(cuda.to_device(np.ascontiguousarray(a)) for a in self.drafter.tables(D, K))
        cols, logp = self.tables[D, K]
        kd.oracle_draft_gpu(self.sequence, L, cols, logp, d_tok, d_logp, self.V, stream=stream)


def drafts_on_device(drafter, model: CudaModel) -> bool:
    """The learned drafter's block and top-k can run inside the step program: it runs on the GPU beside
    this target and the vocabulary fits :func:`kdt.kernels.ddtree.draft_topk`."""
    dm = getattr(drafter, "model", None)
    return isinstance(dm, CudaDraftModel) and dm.embed_tokens is model.embed_tokens and \
        model.cfg.vocab_size <= kd.TOPK_MAX_V


# Launch a device-drafted (or AR) step before the previous step's tokens are read (env KDT_STEP_AHEAD=0: never)
STEP_AHEAD = os.environ.get("KDT_STEP_AHEAD", "1") != "0"
# The host waits for a step by polling its event (env KDT_STEP_WAIT=block: the driver's blocking synchronize). After
# a long blocking wait the host's next Python runs 3-7x slower: H200, Moonlight-16B's oracle budget-64 step (38 ms on
# the GPU), 32 steps, `scripts/profile_step.py moonlight-16b-a3b 256` (session 24, s24e): host work 238 us a step
# blocking (the event record alone 24 us, 3 us after the 7 ms chain step), 79 us polling; the chain step 33 us.
SPIN_WAIT = os.environ.get("KDT_STEP_WAIT", "spin") != "block"
# Steps in turn replay two captures of their program (env KDT_STEP_GRAPHS=2), so a step launched ahead never
# relaunches the graph that the step before it is running (1: one capture a key)
STEP_GRAPHS = int(os.environ.get("KDT_STEP_GRAPHS", "1"))
# The host learns that a step ended from its record row (env KDT_STEP_END=flag): it zeroes the row's count before
# the launch and polls it in mapped memory, which step_commit writes last, after a system fence: no event recorded
# behind the step and no driver call in the wait (event, the default: the event behind the step, queried)
FLAG_WAIT = os.environ.get("KDT_STEP_END", "event") == "flag"


def wait_for(event, spin: bool = SPIN_WAIT, query=None) -> None:
    """Until the work before ``event`` is done: a loop of queries with ``spin`` (the simulator's events have no
    query: they are always done), else the event's blocking synchronize. ``query``: the event's poll, made once
    by :func:`_query` (StepGraph keeps one an event), else made here."""
    query = (query or _query(event)) if spin else None
    if query is None:
        event.synchronize()
    else:
        while not query():
            pass


try:
    from cuda.bindings import driver as _cu
except ImportError:  # (numba-cuda's ctypes binding, or none)
    _cu = None


def _query(event):
    """``event.query`` without an exception a call: numba-cuda's Event.query formats an error message and raises
    and catches a CudaAPIError at every not-ready answer (thousands in a 30 ms step); this asks cuEventQuery of the
    CUDA binding and compares its result code. None for an event without query (the simulator's)."""
    if not hasattr(event, "query"):
        return None
    h = getattr(event, "handle", None)
    if _cu is None or not isinstance(h, _cu.CUevent):
        return event.query
    try:
        _cu.cuEventQuery(h)
    except Exception:  # (a binding that does not take this handle: numba's query)
        return event.query
    done, busy = _cu.CUresult.CUDA_SUCCESS, _cu.CUresult.CUDA_ERROR_NOT_READY

    def query() -> bool:
        err = _cu.cuEventQuery(h)[0]
        if err == busy:
            return False
        return err == done or event.query()  # (another code: numba's query raises it)

    return query


class StepGraph:
    """One greedy DDTree step as one device program (see the module docstring), per key
    ``(budget, D, K, drafted on the device)``: budget nodes, D = depth, K candidates per depth; budget 0
    is an AR step.
    ``start(L, root)`` after the prefill; then each ``step`` returns the committed tokens."""

    def __init__(self, ops: CudaTreeOps, draft_model: CudaDraftModel | None, oracle: DeviceOracle | None = None):
        self.ops, self.model, self.draft_model, self.oracle = ops, ops.model, draft_model, oracle
        self.drafter = None
        n = ops.nmax
        # two rows [1 + a, committed tokens] in host memory mapped into the device, written in turn by
        # step_commit over the bus (no copy call; the device's count ``seq`` picks the row); a row is read
        # after the event that follows its step's launch, each step has its event
        self.record = cuda.mapped_array((2, 1 + n), np.int64)
        self.seq = cuda.to_device(np.zeros(1, np.int64))
        self.done = [cuda.event() if IS_SIM else cuda.event(timing=False) for _ in range(2)]
        self.polls = [_query(e) for e in self.done]  # their queries for wait_for, made once
        self.launched = 0  # steps launched since start() (or a discard); the device's seq counts the same
        # launched, not yet read, oldest first: (count, drafted on the device, pending_ctx before it)
        self.in_flight: list[tuple[int, bool, bool]] = []
        self.pending_ctx = False  # the drafter holds context rows not yet in its cache (finish() adds them)
        self.dropped = 0  # steps launched ahead and dropped (discard)
        self.graphs = ForwardGraphs(self._program) if self.model.graphs is not None else None
        self.wait_s = 0.0  # time the host waited for the steps' programs (on the event behind each)
        self.launch_s = 0.0  # time the host spent in launch(): checks, host draft uploads, the program's launch

    @property
    def drafts_on_device(self) -> bool:
        return self.draft_model is not None or self.oracle is not None

    def start(self, L: int, root: int) -> None:
        """The device state after the prefill: prefix length L (cache slots [0, L) hold the prompt) and
        the root (committed, not cached)."""
        if self.in_flight:
            raise RuntimeError("StepGraph.start with steps in flight: read or discard them first")
        self._set_target(L, root)
        self.pending_ctx = False
        if self.oracle is not None:
            self.oracle.load(self.drafter)
        if self.draft_model is not None:  # its context holds [0, L) (the prefill's rows)
            self._set_drafter(L)

    def _set_target(self, L: int, root: int) -> None:
        """The target's prefix L and root on the device; the step count (record row) from 0."""
        self.model.buf.L.copy_to_device(np.array([L], np.int64))
        self.ops.root.copy_to_device(np.array([root], np.int64))
        self.seq.copy_to_device(np.zeros(1, np.int64))
        self.launched = 0

    def _set_drafter(self, L: int) -> None:
        """The drafter's context [0, L) in its cache, none pending; the block of the current root staged."""
        dm = self.draft_model
        dm.n_ctx.copy_to_device(np.zeros(1, np.int32))
        dm.L_ctx.copy_to_device(np.array([L], np.int64))
        self._stage_draft(True)
        self.pending_ctx = False

    def pipelines(self, budget: int) -> bool:
        """A step of ``budget`` may be launched before the previous step's tokens are read: it drafts on
        the device (or is autoregressive), so it needs nothing from the host."""
        return STEP_AHEAD and (budget == 0 or self.drafts_on_device)

    def launch(self, budget: int, D: int, K: int, draft=None) -> None:
        """Launch one step with ``budget`` nodes (0: autoregressive), depth D, K candidates per depth; ``draft``
        = (tokens [D, K], logp [D, K]) from a host drafter, None when the program drafts (or budget 0).
        It starts from the device state the steps launched before it leave; ``result`` reads its tokens.
        At most two steps are in flight (the record has two rows)."""
        t0 = time.perf_counter()
        if len(self.in_flight) >= 2:
            raise RuntimeError("StepGraph.launch: two steps in flight already (read one with result())")
        if budget > 0:
            self.ops.check_budget(budget)
            if draft is None and not self.drafts_on_device:
                raise ValueError("this step program does not draft on the device: pass the draft")
            if draft is None and self.draft_model is not None and D > self.draft_model.dcfg.block_size - 1:
                raise ValueError(f"the learned drafter drafts {self.draft_model.dcfg.block_size - 1} depths "
                                 f"(block size {self.draft_model.dcfg.block_size}), {D} asked")
            if draft is not None:
                if self.in_flight:  # the mapped draft arrays are read by the step in flight
                    raise RuntimeError("StepGraph.launch: a host draft while a step is in flight")
                D, K = draft[0].shape
                self.ops.upload_draft(*draft)
            key = (int(budget), int(D), int(K), draft is None)
        else:
            key = (0, 1, 1, False)
        drafted = key[3] and self.draft_model is not None  # its drafter forward takes the pending rows in
        if FLAG_WAIT:  # (the row's last reader, result() of the step two before, has read it)
            self.record[self.launched & 1, 0] = 0
        if self.graphs is None:
            self._program(key)
        else:
            self.graphs.run(key + (self.launched % STEP_GRAPHS,))
        if not FLAG_WAIT:
            self.done[self.launched & 1].record()  # on stream 0, behind the step
        self.in_flight.append((self.launched, drafted, self.pending_ctx))
        self.launched += 1
        self.pending_ctx = self.pending_ctx or drafted
        self.launch_s += time.perf_counter() - t0

    def result(self) -> list[int]:
        """The tokens committed by the oldest step in flight (waits for it: the steps' only synchronisation)."""
        i = self.in_flight.pop(0)[0]
        t1 = time.perf_counter()
        row = self.record[i & 1]
        if FLAG_WAIT:
            while row[0] == 0:  # the count (>= 1), written last by step_commit
                pass
        else:
            wait_for(self.done[i & 1], query=self.polls[i & 1])
        self.wait_s += time.perf_counter() - t1
        n = int(row[0])
        self.model.buf.vis_host = None
        return row[1: 1 + n].tolist()

    def step(self, budget: int, D: int, K: int, draft=None) -> list[int]:
        """One step, launched and read (:meth:`launch`, :meth:`result`)."""
        self.launch(budget, D, K, draft)
        return self.result()

    def discard(self, L: int, root: int) -> None:
        """Drop the steps in flight (launched ahead of a step that ended the generation): the device state
        goes back to that of the last step read, prefix L and ``root`` (its bonus token). What a dropped
        step changed beyond that is the cache past L (free slots) and the scalars reset here; its drafter
        forward wrote the read step's context rows into the drafter's cache, as ``finish`` would have."""
        if not self.in_flight:
            return
        _, drafted, pending = self.in_flight[0]
        if any(f[1] != drafted for f in self.in_flight):
            raise RuntimeError("StepGraph.discard: steps in flight of both kinds (drafted and not)")
        if FLAG_WAIT:
            cuda.synchronize()
        else:
            self.done[self.in_flight[-1][0] & 1].synchronize()
        self.dropped += len(self.in_flight)
        self.in_flight.clear()
        self._set_target(L, root)
        self.pending_ctx = pending
        if drafted:  # the dropped forward took the read step's context rows in: none pending, the block staged
            self._set_drafter(L)
            if self.drafter is not None:
                self.drafter.committed = L

    def finish(self, L: int) -> None:
        """After the last step: the drafter's pending context rows (the last step's accepted nodes) into
        its cache, so that its state equals the separate-calls path's (context [0, L))."""
        dm = self.draft_model
        if dm is None or self.drafter is None or not self.pending_ctx:
            return
        self._stage_draft(False)
        dm.context_program(dm.dcfg.block_size, dm.vis_causal)
        dm.n_ctx.copy_to_device(np.zeros(1, np.int32))
        self.pending_ctx = False
        self.drafter.committed = L

    def _stage_draft(self, with_block: bool) -> None:
        """The drafter's rows from the device state (:func:`kdt.kernels.ddtree.stage_draft`): its pending
        context rows, with ``with_block`` then the block of the current root."""
        dm = self.draft_model
        db = dm.buf
        kd.stage_draft(dm.L_ctx, dm.n_ctx, self.model.buf.L, self.ops.root, dm.dcfg.block_size, with_block, db.tokens,
                       db.positions, db.L, dm.vis_step, dm.embed_tokens, dm.mask_rows, db.x)

    def _program(self, key: tuple, stream=0) -> None:
        budget, D, K, device_draft = key[:4]  # (a graph key's fifth entry: which of the STEP_GRAPHS captures)
        m, ops, s = self.model, self.ops, stream
        b, t, acc = m.buf, ops.tree, ops.acc
        d_tok, d_logp = ops.draft_buffers(D, K, mapped=not device_draft)
        dm = self.draft_model if device_draft else None
        if dm is not None:  # the drafter: last step's context rows + this root's block, then top-K per depth
            B, db = dm.dcfg.block_size, dm.buf
            dm.step_program(s)  # its rows staged by the previous step's gather_accepted (the first: by start)
            kd.topk_gpu(db.logits[:D], d_tok, d_logp, stream=s)
        elif device_draft:  # the oracle's draft from its sequence at the device's L
            self.oracle.program(b.L, d_tok, d_logp, s)
        kd.build_tree_gpu(ops.root, d_tok, d_logp, budget, b.L, out=t, stream=s)
        n = min(budget, D * K) + 1  # best-first search pops every reachable candidate up to the budget
        stage_tree(t, n, m, s)
        m._program(n, s)
        ew.argmax_rows(b.logits[:n], b.choice[:n], stream=s, scratch=b.argmax)
        kd.accept_gpu(t.first_child, t.next_sibling, t.tokens, b.choice[: ops.nmax].reshape(1, ops.nmax),
                      t.n_nodes, out=acc, stream=s)
        kd.compact_gpu(m.c_kv, m.k_pe, b.L, acc.accepted[0], acc.n_accepted, stream=s, kv_hl=m.kv_hl)
        if dm is not None:  # the accepted nodes' features: the drafter's context rows of the next step, and
            # the next step's drafter rows staged (its block: the bonus token's)
            kd.gather_accepted(m.feat, acc.accepted, acc.n_accepted, b.L, acc.bonus, dm.feat_in[:B], dm.n_ctx,
                               dm.L_ctx, db.tokens, db.positions, db.L, dm.vis_step, dm.embed_tokens, dm.mask_rows,
                               db.x, stream=s)
        kd.step_commit[1, 128, s](acc.accepted, acc.n_accepted, acc.bonus, b.choice, b.L, ops.root, self.record,
                                  self.seq)
