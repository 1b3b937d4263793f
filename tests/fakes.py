"""Stand-ins that several test modules share: a scripted policy (fixed replies through a real tokenizer), a real
policy with one method overridden, and a coach context with every field filled. Each behaves like the real thing
on the surface a test reaches, so a test that uses one still exercises the real workflow, sandbox or coach."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mappa.models import tiny_tokenizer
from mappa.policy import Generation, Policy
from mappa.types import CoachContext, ExecResult, Message

Reply = Callable[[str | None, Sequence[Message]], str]  # (agent, conversation) -> the agent's reply


class ScriptedPolicy:
    """Same `chat_ids`/`generate` surface as mappa.policy.Policy; replies come from a script, not a model.

    Like the real policy, a reply longer than `max_new_tokens` is cut there and marked truncated, and a prompt
    longer than `max_context_tokens` fails: the workflow under test must fit its prompts itself."""

    def __init__(self, reply: Reply) -> None:
        self.tokenizer = tiny_tokenizer()
        self.reply = reply
        self.calls: list[tuple[str | None, int]] = []  # (agent, conversations) per generate call
        self.seeds: list[int | Sequence[int] | None] = []  # the sampling seed(s) of each generate call

    def chat_ids(self, messages: Sequence[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(
        self,
        agent: str | None,
        conversations: Sequence[Sequence[Message]],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        max_context_tokens: int | None = None,
        top_logprobs: int = 0,
        seed: int | Sequence[int] | None = None,
        batch_size: int | None = None,
    ) -> list[Generation]:
        self.calls.append((agent, len(conversations)))
        self.seeds.append(seed)
        out = []
        for conv in conversations:
            prompt = self.chat_ids(conv)
            assert max_context_tokens is None or len(prompt) <= max_context_tokens  # the engine must fit prompts
            ids = self.tokenizer(self.reply(agent, conv), add_special_tokens=False)["input_ids"]
            truncated = len(ids) > max_new_tokens
            ids = ids[:max_new_tokens] if truncated else [*ids, self.tokenizer.eos_token_id]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append(Generation(tuple(prompt), tuple(ids), tuple(-0.5 for _ in ids), text, truncated))
        return out


class Miswired:
    """A real Policy behind one wiring bug, as a policy implementation could have it: everything is the real
    policy's except the method a subclass overrides."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner

    def __getattr__(self, name: str):  # noqa: ANN204 - the real policy's attribute
        return getattr(self.inner, name)


def coach_context(**kw: object) -> CoachContext:
    """The Code Executor's context after a tool call that printed the answer of 2 + 3; `kw` replaces fields."""
    base: dict[str, object] = dict(
        task="What is 2 + 3?",
        workflow="mathchat",
        agent="code_executor",
        role="You are the Code Executor. Write a ```python code block that computes the answer.",
        is_final=False,
        messages=(Message(role="system", content="role"), Message(role="user", content="Problem: 2 + 3")),
        output="```python\nprint(2 + 3)\n```",
        exec_result=ExecResult(ok=True, exit_code=0, stdout="5\n"),
        observation="5",
    )
    return CoachContext(**{**base, **kw})


def play_scripted(workflow, tasks, policy, sandbox, scorer=None, *, gen=None, seed=0, **kw):  # type: ignore[no-untyped-def]
    """`mappa.workflows.play` of `workflow` with a scripted (or any batched) policy behind `PolicyGenerator`, at `gen`'s
    sampling settings (default: GenerationConfig's)."""
    from mappa.config import GenerationConfig
    from mappa.generation import PolicyGenerator
    from mappa.protocols import Runtime
    from mappa.workflows import play

    rt = Runtime(PolicyGenerator(policy), sandbox, scorer)
    return play(workflow, tasks, rt, sampling=(gen or GenerationConfig()).sampling(), seed=seed, **kw)
