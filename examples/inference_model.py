"""The reference server's model and batcher, with no HTTP in them.

Model: a small transformer-shaped stack with random weights (no download): token embedding,
`layers` residual blocks x + tanh(x W), and logits against the embedding. Prefill runs every
prompt token through the stack (cost grows with prompt length); a decode step runs one token
per active sequence. PyTorch when importable (CPU, or CUDA on a compute stream whose priority
the agent may set), else numpy with the same shapes.

Batcher, `continuous` (default): requests wait in `pending`; they are admitted when the
running batch has room and either enough are waiting to fill it or the oldest has waited the
batch window. Each engine step prefills up to `prefill_chunk` prompt tokens of admitted
sequences (chunked prefill; a sequence whose prompt completes yields its first token) and
decodes one token for every sequence already past prefill. Tokens go to `deliver` once per
step.

Batcher `window`: a dynamic batcher that dispatches whole batches, as Triton's does to a
model with several instances on one device. The oldest waiting request opens a window; when
it closes, or `max_batch` are waiting, the waiting requests become one batch, which runs to
its end as its own group: no request joins it later. Groups run side by side (at most
`instances` at once, 0: no bound), one model call per group in turn, each call paying the
step floor: the device is shared, so many small groups cost many small calls. A longer
window makes larger groups, fewer calls per token and more waiting per request.
"""

from __future__ import annotations

import importlib
import queue
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

Vector = npt.NDArray[np.float32]


@dataclass(frozen=True)
class Shape:
    hidden: int = 512
    layers: int = 4
    vocab: int = 8192


class Model(Protocol):
    shape: Shape

    def forward(self, token_ids: list[npt.NDArray[np.int64]],
                pooled: bool) -> tuple[list[int], list[Vector]]:
        """Run each sequence's tokens through the stack; per sequence the next token (argmax at
        its last position) and, when `pooled`, the mean of its final hidden states."""
        ...


class NumpyModel:
    """float32 numpy stand-in; one BLAS call per layer for the whole step."""

    def __init__(self, shape: Shape, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.shape = shape
        scale = 1.0 / np.sqrt(shape.hidden)
        self.embed = rng.standard_normal((shape.vocab, shape.hidden), dtype=np.float32) * scale
        self.weights = [rng.standard_normal((shape.hidden, shape.hidden), dtype=np.float32) * scale
                        for _ in range(shape.layers)]

    def forward(self, token_ids: list[npt.NDArray[np.int64]],
                pooled: bool) -> tuple[list[int], list[Vector]]:
        lengths = [len(t) for t in token_ids]
        x = self.embed[np.concatenate(token_ids)]
        for w in self.weights:
            x = x + np.tanh(x @ w)
        ends = np.cumsum(lengths)
        logits = x[ends - 1] @ self.embed.T
        nxt = [int(i) for i in np.argmax(logits, axis=1)]
        pools = [x[e - n:e].mean(axis=0) for e, n in zip(ends, lengths, strict=True)] if pooled else []
        return nxt, pools


class TorchModel:
    """The same stack in PyTorch; on CUDA it runs on its own stream at `priority`."""

    def __init__(self, torch: ModuleType, shape: Shape, device: str, priority: int | None,
                 seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.torch = torch
        self.shape = shape
        self.device = torch.device(device)
        scale = 1.0 / shape.hidden ** 0.5
        self.embed = torch.randn(shape.vocab, shape.hidden, device=self.device) * scale
        self.weights = [torch.randn(shape.hidden, shape.hidden, device=self.device) * scale
                        for _ in range(shape.layers)]
        self.stream = (torch.cuda.Stream(device=self.device, priority=priority or 0)
                       if self.device.type == "cuda" else None)

    def forward(self, token_ids: list[npt.NDArray[np.int64]],
                pooled: bool) -> tuple[list[int], list[Vector]]:
        torch = self.torch
        lengths = [len(t) for t in token_ids]
        ids = torch.from_numpy(np.concatenate(token_ids)).to(self.device, non_blocking=True)
        with torch.inference_mode(), _maybe_stream(torch, self.stream):
            x = self.embed[ids]
            for w in self.weights:
                x = x + torch.tanh(x @ w)
            ends = torch.tensor(np.cumsum(lengths), device=self.device)
            nxt = torch.argmax(x[ends - 1] @ self.embed.T, dim=1).cpu().tolist()
            pools = ([p.mean(dim=0).float().cpu().numpy() for p in torch.split(x, lengths)]
                     if pooled else [])
        return [int(i) for i in nxt], pools


def _maybe_stream(torch: ModuleType, stream: Any) -> Any:
    import contextlib
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def load_torch() -> ModuleType | None:
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def build_model(backend: str, device: str, shape: Shape,
                priority: Callable[[ModuleType], int | None]) -> Model:
    """backend: auto (torch if importable), torch, numpy. A clear ValueError when impossible."""
    torch = load_torch() if backend in ("auto", "torch") else None
    if backend == "torch" and torch is None:
        raise ValueError("--backend torch: PyTorch is not installed")
    if device == "cuda" and (torch is None or not torch.cuda.is_available()):
        raise ValueError("--device cuda needs PyTorch with a CUDA device")
    if torch is None:
        return NumpyModel(shape)
    return TorchModel(torch, shape, device, priority(torch) if device == "cuda" else None)


def prompt_token_ids(text_hash: int, n: int, vocab: int) -> npt.NDArray[np.int64]:
    """Deterministic stand-in token ids for a prompt of n tokens."""
    return (np.arange(n, dtype=np.int64) * 2654435761 + text_hash) % vocab


def text_hash(text: str) -> int:
    return zlib.crc32(text.encode())


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. `max_tokens == 0` asks for a pooled embedding only."""

    prompt_ids: npt.NDArray[np.int64]
    max_tokens: int
    arrival: float = field(default_factory=time.perf_counter)
    prefilled: int = 0
    generated: int = 0
    last_token: int = 0
    cancelled: bool = False
    pool_sum: Vector | None = None
    sink: Any = None  # the server's per-request handle; the engine does not touch it

    @property
    def in_prefill(self) -> bool:
        return self.prefilled < len(self.prompt_ids)

    @property
    def done(self) -> bool:
        return not self.in_prefill and self.generated >= self.max_tokens


@dataclass(frozen=True)
class Event:
    """What one step produced for one sequence: a token, or (embeddings) the pooled vector."""

    seq: Sequence
    token: int | None
    vector: Vector | None
    finished: bool


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    last_batch: int = 0
    queue_depth: int = 0
    active: int = 0
    submitted: int = 0  # requests handed to the engine since it started (the arrivals)


BATCHERS = ("continuous", "window")


class Engine:
    """The batcher: one thread runs model steps; `submit` and `cancel` are thread-safe."""

    def __init__(self, model: Model, deliver: Callable[[list[Event]], None], max_batch: int,
                 window_ms: float, prefill_chunk: int = 512, step_floor_ms: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter, batcher: str = "continuous",
                 instances: int = 0) -> None:
        if batcher not in BATCHERS:
            raise ValueError(f"unknown batcher {batcher!r} ({', '.join(BATCHERS)})")
        self.batcher = batcher
        self.instances = instances  # window batcher: groups running at once (0: no bound)
        self._groups: list[list[Sequence]] = []  # window batcher: the dispatched batches
        self._turn = 0  # window batcher: the group whose call is next
        self.model = model
        self.deliver = deliver
        self.max_batch = max_batch
        self.window_ms = window_ms  # the control thread may change it at any time
        self.prefill_chunk = prefill_chunk
        self.step_floor_s = step_floor_ms / 1000.0
        self.stats = EngineStats()
        self._clock = clock
        self._inbox: queue.SimpleQueue[Sequence | None] = queue.SimpleQueue()
        self._pending: list[Sequence] = []
        self._active: list[Sequence] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=5)

    def submit(self, seq: Sequence) -> None:
        self.stats.submitted += 1  # the server's event loop is the one caller
        self._inbox.put(seq)

    def queue_depth(self) -> int:
        """Requests that have not had their first token: waiting to be admitted and, with the
        window batcher, dispatched in a group whose prefill has not run yet."""
        waiting = len(self._pending) + self._inbox.qsize()
        if self.batcher == "window":
            waiting += sum(1 for g in list(self._groups) for s in list(g) if s.in_prefill)
        return waiting

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(self._idle_wait())
            self.tick()

    def tick(self) -> None:
        """One pass of the engine thread, on what has arrived: admit or dispatch what is
        due, then one model call."""
        if self.batcher == "window":
            self._dispatch()
            if self._groups:
                self._group_step()
        else:
            self._admit()
            if self._active:
                self.step()
        self.stats.queue_depth = self.queue_depth()
        self.stats.active = len(self._active) + sum(len(g) for g in self._groups)

    def _idle_wait(self) -> float | None:
        """How long to block for new requests: 0 while running, until the window ends while
        only waiting ones exist, forever when idle."""
        if self._active or self._groups:
            return 0.0
        if self._pending:
            return max(0.0, self._pending[0].arrival + self.window_ms / 1000 - self._clock())
        return None

    def _drain(self, wait: float | None) -> None:
        try:
            item = self._inbox.get(timeout=wait) if wait != 0.0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            self._pending.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self) -> None:
        self._pending = [s for s in self._pending if not s.cancelled]
        room = self.max_batch - len(self._active)
        if not self._pending or room <= 0:
            return
        waited = self._clock() - self._pending[0].arrival
        if len(self._pending) >= room or waited >= self.window_ms / 1000:
            self._active.extend(self._pending[:room])
            del self._pending[:room]

    def _dispatch(self) -> None:
        """Window batcher: the waiting requests become a group when the oldest has waited the
        window or a full batch waits, while an instance is free."""
        self._pending = [s for s in self._pending if not s.cancelled]
        while self._pending and (not self.instances or len(self._groups) < self.instances):
            waited = self._clock() - self._pending[0].arrival
            if len(self._pending) < self.max_batch and waited < self.window_ms / 1000:
                return
            group = self._pending[:self.max_batch]
            del self._pending[:self.max_batch]
            self._groups.append(group)
            self.stats.last_batch = len(group)

    def _group_step(self) -> None:
        """Window batcher: one model call for the group whose turn it is."""
        self._turn %= len(self._groups)
        group = self._groups[self._turn]
        group[:], _ = self._run_call(group)
        if group:
            self._turn += 1
        else:
            del self._groups[self._turn]

    def step(self) -> None:
        """One model call: a prefill chunk for sequences still in prefill, one decode token for
        the others; then deliver what it produced."""
        self._active, n = self._run_call(self._active)
        if n:
            self.stats.last_batch = n

    def _run_call(self, batch: list[Sequence]) -> tuple[list[Sequence], int]:
        """One model call over `batch`: the sequences of it not yet done, and how many the
        call ran."""
        started = self._clock()
        batch = [s for s in batch if not s.cancelled]
        work = self._plan(batch)
        if not work:
            return batch, 0
        ids = [w[1] for w in work]
        nxt, pools = self.model.forward(ids, pooled=any(s.max_tokens == 0 for s, _ in work))
        events = [self._advance(s, len(t), n, pools[i] if pools else None)
                  for i, ((s, t), n) in enumerate(zip(work, nxt, strict=True))]
        self.stats.steps += 1
        produced = [e for e in events if e is not None]
        self.stats.tokens += sum(1 for e in produced if e.token is not None)
        self._floor(started)
        if produced:
            self.deliver(produced)
        return [s for s in batch if not s.done], len(work)

    def _plan(self, batch: list[Sequence]) -> list[tuple[Sequence, npt.NDArray[np.int64]]]:
        budget = self.prefill_chunk
        work: list[tuple[Sequence, npt.NDArray[np.int64]]] = []
        for s in batch:
            if not s.in_prefill:
                nxt = (s.last_token + 7919 * s.generated) % self.model.shape.vocab  # vary output
                work.append((s, np.array([nxt], dtype=np.int64)))
            elif budget > 0:
                take = s.prompt_ids[s.prefilled:s.prefilled + budget]
                budget -= len(take)
                self.stats.prefill_tokens += len(take)
                work.append((s, take))
        return work

    def _advance(self, s: Sequence, n: int, token: int, pool: Vector | None) -> Event | None:
        was_prefill = s.in_prefill
        if was_prefill:
            s.prefilled += n
            if pool is not None:
                s.pool_sum = pool * n if s.pool_sum is None else s.pool_sum + pool * n
            if s.in_prefill:
                return None  # more prompt to go: nothing to say yet
            if s.max_tokens == 0:
                assert s.pool_sum is not None
                return Event(s, None, (s.pool_sum / len(s.prompt_ids)).astype(np.float32), True)
        s.generated += 1
        s.last_token = token
        return Event(s, token, None, s.done)

    def _floor(self, started: float) -> None:
        left = self.step_floor_s - (self._clock() - started)
        if left > 0:
            time.sleep(left)
