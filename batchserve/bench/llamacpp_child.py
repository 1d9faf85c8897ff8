"""The `llamacpp` peer in a child process of its own, rerun on llama.cpp's other kernels if it crashes.

llama-cpp-python runs llama.cpp inside the process that loads it, so a crash in llama.cpp's
kernels (SIGILL in its AMX kernels where a VM lists AMX but does not grant it) would end the
bench. The child (`multiprocessing`'s spawn: no state forked from the bench) loads the model
once and runs `run_llamacpp` for each job it is sent, returning the same `PeerRun` the
in-process peer returns. If it dies without a result (a signal, a non-zero exit) or reports an
error, it is started again with llama.cpp's extra buffer types off (`use_extra_bufts=False`: no
repacked or AMX weights, its plain CPU kernels) and the job rerun; `note` then says so. Where
that fails too, `run` raises `PeerFailed` with both reasons.
"""

from __future__ import annotations

import inspect
import multiprocessing
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from batchserve.bench.crashes import PeerFailed, exit_reason
from batchserve.bench.peers import PeerRun, run_llamacpp

RUN_TIMEOUT_S = 4 * 3600.0  # a load and one run of every prompt, one at a time, on a slow CPU
STOP_TIMEOUT_S = 10.0  # a child told to stop exits at once; past this it is killed
FALLBACK = "use_extra_bufts=False"


@dataclass(frozen=True, slots=True)
class LlamaSettings:
    """What the child loads: the GGUF, a context for the longest prompt and its output, the
    bench's thread count, the GPU layers; `extra_bufts` False: llama.cpp's fallback kernels."""

    gguf: str
    n_ctx: int
    threads: int
    gpu_layers: int
    extra_bufts: bool = True

    def kwargs(self) -> dict[str, Any]:
        """`Llama(...)`'s arguments (llama.cpp's own default threads for prompts is every core)."""
        return dict(
            model_path=self.gguf, n_ctx=self.n_ctx, n_threads=self.threads, n_threads_batch=self.threads,
            n_batch=512, n_gpu_layers=self.gpu_layers, logits_all=False, verbose=False,
        )  # fmt: skip


Loader = Callable[[LlamaSettings], Any]  # settings -> an object with llama_cpp.Llama's reset/generate


def make_llama(settings: LlamaSettings) -> Any:
    """llama-cpp-python's `Llama` on `settings`; run in the child only: the fallback changes
    llama-cpp-python's model defaults for the rest of the process."""
    from llama_cpp import Llama

    kwargs = settings.kwargs()
    if not settings.extra_bufts:
        if "use_extra_bufts" in inspect.signature(Llama).parameters:
            kwargs["use_extra_bufts"] = False
        else:
            _without_extra_bufts()
    return Llama(**kwargs)


def _without_extra_bufts() -> None:
    """llama-cpp-python 0.3's `Llama` takes no `use_extra_bufts` (its `**kwargs` would swallow it
    unused): it builds its model parameters from `llama_model_default_params()`, looked up at
    each call, so that function is wrapped to turn the field off."""
    import llama_cpp.llama_cpp as native

    defaults = native.llama_model_default_params
    if not hasattr(defaults(), "use_extra_bufts"):
        raise RuntimeError("this llama-cpp-python cannot turn off llama.cpp's extra buffer types")

    def without() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    native.llama_model_default_params = without


def serve(conn: Connection, settings: LlamaSettings, load: Loader) -> None:
    """The child: load once, then answer each job (prompts, max_new, stop ids, label) with
    ("ok", PeerRun) until told None; an exception is answered ("error", what it was)."""
    try:
        llm = load(settings)
        while (job := conn.recv()) is not None:
            prompts, max_new, stop, desc = job
            conn.send(("ok", run_llamacpp(llm, prompts, max_new, stop, desc)))
    except EOFError:  # the bench is gone
        return
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)


@dataclass(frozen=True, slots=True)
class _Failure:
    why: str  # `crashed (SIGILL)`, `failed (ValueError: ...)`, ...
    rerun: bool = True  # False: a run that took too long, which other kernels would not cure
    signal: bool = False  # it died by a signal


@dataclass(slots=True)
class LlamaCppChild:
    """The `llamacpp` peer's child process: started at its first run, kept for later runs (the
    rounds of a repeated sweep load the model once), stopped by `close`. `load` is what the child
    calls to get its `Llama` (a module-level function: spawn pickles it by name)."""

    settings: LlamaSettings
    load: Loader = make_llama
    timeout_s: float = RUN_TIMEOUT_S  # for one run's answer, the child's load included
    note: str | None = None  # set when it runs on the fallback kernels: the report row says so
    failed: str | None = None  # set when it failed both ways: later runs fail at once
    _proc: BaseProcess | None = field(default=None, repr=False)
    _conn: Connection | None = field(default=None, repr=False)

    def run(self, prompts: list[list[int]], max_new: int, stop: Collection[int], desc: str) -> PeerRun:
        """llama.cpp greedy over `prompts`, one at a time (`run_llamacpp`), in the child."""
        if self.failed is not None:
            raise PeerFailed(self.failed)
        job = (prompts, max_new, frozenset(stop), desc)
        first = self._attempt(job)
        if isinstance(first, PeerRun):
            return first
        if not first.rerun or not self.settings.extra_bufts:
            kernels = "on its default kernels" if self.settings.extra_bufts else f"with {FALLBACK}"
            raise self._fail(f"llamacpp {first.why} {kernels}")
        self.settings = replace(self.settings, extra_bufts=False)
        again = self._attempt(job)
        if isinstance(again, PeerRun):
            what = "llama.cpp's AMX/repacked kernels" if first.signal else "llama.cpp on its default kernels"
            self.note = f"{what} {first.why}; rerun with {FALLBACK}"
            return again
        raise self._fail(f"llamacpp {first.why} on its default kernels, and {again.why} with {FALLBACK}")

    def _fail(self, why: str) -> PeerFailed:
        self.close()
        self.failed = why
        return PeerFailed(why)

    def _attempt(self, job: tuple[Any, ...]) -> PeerRun | _Failure:
        """One job in the child (started if it is not running): its run, or why there is none."""
        conn, proc = self._started()
        try:
            conn.send(job)
        except OSError:  # it has died already: its exit says how
            pass
        ready = wait([conn, proc.sentinel], self.timeout_s)
        if not ready:
            self.close(grace=0.0)  # stuck: asking it to stop would wait for nothing
            return _Failure(f"gave no result within {self.timeout_s:.0f} s", rerun=False)
        if conn in ready:  # before the sentinel: an answer sent just before exiting still counts
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                pass
            else:
                if kind == "ok":
                    return value  # type: ignore[no-any-return]
                self.close()
                return _Failure(f"failed ({value})")
        proc.join(STOP_TIMEOUT_S)
        code = proc.exitcode
        self.close()
        if code is not None and code < 0:
            return _Failure(exit_reason(code), signal=True)
        return _Failure(f"{exit_reason(code)} without a result")

    def _started(self) -> tuple[Connection, BaseProcess]:
        if self._proc is None or self._conn is None:
            ctx = multiprocessing.get_context("spawn")
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(theirs, self.settings, self.load), daemon=True, name="llamacpp")
            proc.start()
            theirs.close()  # the child holds its end: when it dies, ours reads EOF
            self._proc, self._conn = proc, ours
        return self._conn, self._proc

    def close(self, grace: float = STOP_TIMEOUT_S) -> None:
        """Stop the child (asked, then killed past `grace` seconds); the next run starts another."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            try:
                conn.send(None)
            except OSError:
                pass
            conn.close()
        if proc is not None:
            proc.join(grace)
            if proc.is_alive():
                proc.kill()
                proc.join(STOP_TIMEOUT_S)
            proc.close()


def load_llamacpp(gguf: Path, prompts: list[list[int]], max_new: int, load: Loader = make_llama) -> LlamaCppChild:
    """The `llamacpp` peer on the engine's GGUF: a context that holds the longest prompt and its
    output, the bench's thread count, and all layers on the GPU where torch has one (a CPU-only
    build ignores that). The child starts, and loads, at its first run."""
    import torch

    threads = torch.get_num_threads()
    gpu_layers = -1 if torch.cuda.is_available() else 0
    return LlamaCppChild(LlamaSettings(str(gguf), max(map(len, prompts)) + max_new, threads, gpu_layers), load)
