"""The chat's engine: every MLX call on one long-lived thread (`mlx_spec.worker`), fed by a queue.

The model is loaded, switched and run on that thread, which lives as long as
the process. The app talks to it with `submit` (jobs run in order) and `stop`
(ends the current answer early, keeping what was written); it hears back
through `emit`, called on the engine thread.

The target's KV cache is kept across turns: a new turn's prompt (the whole
conversation through the chat template) usually extends the tokens the cache
holds, so only the new message is read.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Sequence

from mlx_spec import distributed
from mlx_spec.errors import UserError
from mlx_spec.hub import Download, reporting
from mlx_spec.metrics import Metrics
from mlx_spec.worker import Worker

Progress = Download  # an event: how far a download of the model or drafter has come


# --- jobs ----------------------------------------------------------------------

@dataclass
class Load:
    model: str
    drafter: str = "none"
    revision: str | None = None
    drafter_revision: str | None = None
    extra_eos: Sequence[str] = ()  # more tokens to stop at (`--extra-eos-token`)
    adapter_path: str | None = None  # mlx-lm LoRA adapters for the target (`--adapter-path`)
    exact: bool = False  # exact verification (`--exact`)


@dataclass
class SetDrafter:
    spec: str


@dataclass
class Generate:
    messages: list[dict]  # the conversation so far, ending with the user's message
    temp: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    think: bool | None = None  # the chat template's `enable_thinking` (None: its default)
    template_args: dict | None = None  # more arguments for the chat template (`--chat-template-args`)


@dataclass
class Forget:
    """The conversation changed other than by a new turn (cleared, loaded): drop the cache."""


# --- events --------------------------------------------------------------------

@dataclass
class Status:
    text: str


@dataclass
class Notice(Status):
    """A line the user should read, not only see pass (a conversion made on first use)."""


@dataclass
class Loaded:
    model: str
    drafter: str
    thinking_switch: bool = False  # the chat template takes `enable_thinking`


@dataclass
class Begin:
    """An answer starts; `reasoning`: the prompt opened a `<think>` block for it."""

    reasoning: bool


@dataclass
class Piece:
    text: str
    from_draft: bool


@dataclass
class Done:
    text: str
    metrics: Metrics
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose K/V an earlier turn had computed
    prompt_time: float
    generation_time: float
    tokens: int
    finish_reason: str  # stop | length | stopped


@dataclass
class Failed:
    text: str


@dataclass
class State:
    """What the engine thread owns."""

    target: object = None  # api.Target
    model: object = None
    tokenizer: object = None
    model_name: str = ""
    drafter_revision: str | None = None
    drafter: object = None
    drafter_spec: str = "none"
    exact: bool = False
    width: int | None = None  # exact verification: every forward's width, for the drafter in use
    cache: list | None = None
    context: list[int] = field(default_factory=list)  # the tokens the cache was built from


class ChatEngine(Worker):
    def __init__(self, emit: Callable[[object], None]):
        self.emit = emit
        self.jobs: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.state = State()
        super().__init__("mlx-chat")
        self.start()

    def submit(self, job) -> None:
        self.jobs.put(job)

    def stop(self) -> None:
        """End the answer being written (it keeps what it has)."""
        self.stopping.set()

    def idle(self) -> bool:
        return self.jobs.unfinished_tasks == 0

    def turn(self) -> bool:
        self._run(self.jobs.get())
        self.jobs.task_done()
        return False

    def failed(self, error: Exception) -> None:
        """A job failed: the app stays alive and says what happened."""
        text = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
        self.emit(Failed(text.splitlines()[0]))
        self.jobs.task_done()

    def _run(self, job) -> None:
        if isinstance(job, Load):
            self._load(job)
        elif isinstance(job, SetDrafter):
            with reporting(self.emit):
                self._set_drafter(job.spec)
            self._loaded()
        elif isinstance(job, Generate):
            self._generate(job)
        elif isinstance(job, Forget):
            self.state.cache, self.state.context = None, []

    def _load(self, job: Load) -> None:
        from mlx_spec import api

        self.emit(Status(f"loading {job.model}…"))
        api.check_published(job.drafter, job.model)
        with reporting(self.emit):  # a Hub download shows its progress
            target = api.load(job.model, job.revision, extra_eos=job.extra_eos, adapter_path=job.adapter_path,
                              report=self._say)
        s = self.state
        s.target, s.model, s.tokenizer = target, target.model, target.tokenizer
        s.model_name, s.drafter_revision, s.exact = job.model, job.drafter_revision, job.exact
        s.cache, s.context = None, []
        s.drafter, s.drafter_spec = None, "none"
        s.width = api.exact_width(target) if s.exact else None
        if job.drafter != "none":
            self.emit(Status(f"loading drafter {job.drafter}…"))
            with reporting(self.emit):
                self._set_drafter(job.drafter)
        self._loaded()

    def _say(self, message: str) -> None:
        """A line for the user while loading (a conversion on first use, say)."""
        self.emit(Notice(message))

    def _loaded(self) -> None:
        from mlx_spec.tokenizer import has_thinking_switch

        s = self.state
        self.emit(Loaded(s.model_name, s.drafter_spec, has_thinking_switch(s.tokenizer)))

    def _set_drafter(self, spec: str) -> None:
        from mlx_spec import api

        s = self.state
        if s.model is None:
            raise UserError("no model is loaded")
        drafter = api.drafter(spec, s.target, report=self._say, revision=s.drafter_revision)
        width = api.exact_width(s.target, [drafter]) if s.exact else None
        s.drafter, s.drafter_spec, s.width = drafter, spec if drafter is not None else "none", width

    def _generate(self, job: Generate) -> None:
        from mlx_spec.cache import rewound
        from mlx_spec.decoding import plain_steps, speculative_steps
        from mlx_spec.drafters.base import common_prefix
        from mlx_spec.generate import Generation, stream_generate
        from mlx_spec.sampling import SamplingParams
        from mlx_spec.tokenizer import opens_reasoning, render_chat, thinking_args

        s = self.state
        if s.model is None:
            raise UserError("no model is loaded")
        self.stopping.clear()
        prompt = render_chat(s.tokenizer, job.messages, thinking_args(job.think, job.template_args))
        if s.cache is None:
            s.cache, s.context = s.model.make_cache(), []
        # Keep what this prompt shares with the tokens the cache was built from.
        reused = min(common_prefix(s.context, prompt), s.cache[0].offset, len(prompt) - 1)
        s.cache = rewound(s.cache, reused, s.model.make_cache)
        s.context = list(prompt)  # the tokens whose K/V the cache will hold grow from here
        params = SamplingParams(temp=job.temp, top_p=job.top_p)
        if s.drafter is None:
            steps = partial(plain_steps, cache=s.cache, width=s.width)
        else:
            steps = partial(speculative_steps, drafter=s.drafter, cache=s.cache, width=s.width)

        def recorded(*args):
            for event in distributed.lockstep(steps(*args), (args[1:], reused)):  # (args[0]: the model)
                s.context.extend(event.tokens)  # all of them: the cache holds tokens past an EOS too
                yield event

        result = Generation(prompt_tokens=prompt)
        stopped = False
        self.emit(Begin(opens_reasoning(s.tokenizer, prompt)))
        for piece in stream_generate(s.model, s.tokenizer, prompt, params, job.max_tokens, result, recorded):
            self.emit(Piece(piece, result.from_draft[-1]))
            if self.stopping.is_set():
                stopped = True
                break
        self.emit(Done(
            # stopped: the answer is what was shown, the detokenizer's held-back bytes aside
            text=s.tokenizer.decode(result.tokens) if stopped else result.text,
            metrics=result.metrics, prompt_tokens=len(prompt), reused_tokens=reused,
            prompt_time=result.prompt_time, generation_time=result.generation_time,
            tokens=len(result.tokens), finish_reason="stopped" if stopped else result.finish_reason,
        ))
