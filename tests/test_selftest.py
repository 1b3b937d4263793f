"""The self-test, one branch per test: each is fed a real broken input (a policy with aliased or switched-off
adapters, a policy implementation with one wiring bug, a code tool whose limits cannot run `print(6 * 7)`, a
coach endpoint that is down or never writes a score) and must stop with its own one-line reason."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator, Sequence

import pytest
import torch
from helpers import AGENTS, FaultServer, Miswired, make_policy, reply

from mappa.coach import build_coach
from mappa.config import CoachConfig, SandboxConfig
from mappa.errors import MappaError
from mappa.policy.policy import Generation
from mappa.sandbox import Sandbox
from mappa.training.selftest import check_agents, check_coach, check_sandbox

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def one_line(info: pytest.ExceptionInfo[MappaError]) -> str:
    text = str(info.value)
    assert "\n" not in text and text.startswith("self-test: ")
    return text


class NoWeights(Miswired):
    def trainable_parameters(self, agent: str) -> list[torch.nn.Parameter]:
        return [] if agent == "verifier" else self.inner.trainable_parameters(agent)


class VerifierReadsSolver(Miswired):
    """The verifier's forward pass runs on the solver's adapter (trainable_parameters still its own)."""

    def forward_logprobs(self, agent: str | None, prompts, responses):  # noqa: ANN001, ANN201
        return self.inner.forward_logprobs("solver" if agent == "verifier" else agent, prompts, responses)


class GeneratesWithBase(Miswired):
    def generate(self, agent: str | None, conversations, **kw) -> Sequence[Generation]:  # noqa: ANN001
        return self.inner.generate(None, conversations, **kw)


class MisalignedLogprobs(Miswired):
    """Reports each token's log-prob one position late (an off-by-one in the decode loop)."""

    def generate(self, agent: str | None, conversations, **kw) -> Sequence[Generation]:  # noqa: ANN001
        gens = self.inner.generate(agent, conversations, **kw)
        return [dataclasses.replace(g, logprobs=(g.logprobs[0], *g.logprobs[:-1])) for g in gens]


class Silent(Miswired):
    def generate(self, agent: str | None, conversations, **kw) -> Sequence[Generation]:  # noqa: ANN001
        gens = self.inner.generate(agent, conversations, **kw)
        return [dataclasses.replace(g, response_ids=(), logprobs=(), text="") for g in gens]


def test_a_correct_policy_passes_in_every_mode() -> None:
    for mode in ("lora", "full", "shared"):
        lines = check_agents(make_policy(mode), AGENTS)
        assert len(lines) == (1 if mode == "shared" else 3), mode  # shared: one set of weights, checked once


def test_an_agent_without_trainable_weights() -> None:
    with pytest.raises(MappaError) as info:
        check_agents(NoWeights(make_policy()), AGENTS)
    assert one_line(info) == "self-test: agent 'verifier' has no trainable parameters"


def test_aliased_adapters_outside_shared_mode() -> None:
    policy = make_policy()
    policy._adapter["verifier"] = policy._adapter["solver"]  # a mapping bug: the verifier trains the solver's
    with pytest.raises(MappaError) as info:
        check_agents(policy, AGENTS)
    assert "agents 'solver' and 'verifier' share trainable weights" in one_line(info)
    assert "'lora'" in str(info.value) and "aliased adapters" in str(info.value)


def test_adapters_switched_off_in_the_forward_pass() -> None:
    policy = make_policy()
    policy.model.base_model.disable_adapter_layers()  # the adapters exist and train, but nothing reads them
    with pytest.raises(MappaError) as info:
        check_agents(policy, AGENTS)
    assert "perturbing agent 'solver'" in one_line(info) and "adapter not active in the forward pass" in str(
        info.value
    )


def test_an_agent_that_reads_another_agents_weights() -> None:
    with pytest.raises(MappaError) as info:
        check_agents(VerifierReadsSolver(make_policy()), AGENTS)
    assert one_line(info) == "self-test: agent 'verifier' changed when only 'solver''s weights did"


def test_generation_with_the_base_weights() -> None:
    with pytest.raises(MappaError) as info:
        check_agents(GeneratesWithBase(make_policy()), AGENTS)
    assert one_line(info) == "self-test: agent 'solver' generates with the base weights, not its own"


def test_generation_reports_misaligned_logprobs() -> None:
    with pytest.raises(MappaError) as info:
        check_agents(MisalignedLogprobs(make_policy()), AGENTS)
    assert "agent 'solver': generate's log-probs differ from the forward pass" in one_line(info)


def test_generation_without_tokens() -> None:
    with pytest.raises(MappaError) as info:
        check_agents(Silent(make_policy()), AGENTS)
    assert one_line(info) == "self-test: agent 'solver' generated no tokens"


def test_the_self_test_restores_every_weight() -> None:
    policy = make_policy()
    before = {a: [p.detach().clone() for p in policy.trainable_parameters(a)] for a in AGENTS}
    check_agents(policy, AGENTS)
    for a in AGENTS:
        assert all(torch.equal(b, p) for b, p in zip(before[a], policy.trainable_parameters(a), strict=True))


# ------------------------------------------------------------------------------------------------- code tool
def test_a_code_tool_that_runs_it() -> None:
    with Sandbox(SandboxConfig(pool=False)) as sandbox:
        assert check_sandbox(sandbox).startswith("code tool: print(6 * 7) -> 42")


def test_a_code_tool_that_cannot_run_it() -> None:
    # A wall-clock limit no interpreter starts within: the tool is reached but never prints 42.
    with Sandbox(SandboxConfig(pool=False, timeout_s=0.001)) as sandbox, pytest.raises(MappaError) as info:
        check_sandbox(sandbox)
    assert one_line(info) == "self-test: the code tool failed on print(6 * 7): timed out"


# ----------------------------------------------------------------------------------------------------- coach
def closed_port() -> int:
    """A port nothing listens on: bound, then closed (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def coach_at() -> Iterator:
    runners = []

    def build(url: str):  # noqa: ANN202
        cfg = CoachConfig(
            backend="openai", model="judge", base_url=url, api_key_env="MAPPA_TEST_NO_SUCH_KEY", max_retries=0,
            cache=False,
        )  # fmt: skip
        runners.append(build_coach(cfg, "mathchat"))
        return runners[-1]

    yield build
    for r in runners:
        r.close()


def test_a_coach_that_answers_with_a_score(coach_at) -> None:  # noqa: ANN001
    server = FaultServer({"default": [reply("Correct and clear.\nPROCESS_SCORE: 9")]})
    try:
        assert check_coach(coach_at(server.url).score_many, "mathchat", "verifier").startswith("coach: reply parsed")
    finally:
        server.close()


def test_a_coach_endpoint_that_is_down(coach_at) -> None:  # noqa: ANN001
    url = f"http://127.0.0.1:{closed_port()}/v1"
    with pytest.raises(MappaError) as info:
        check_coach(coach_at(url).score_many, "mathchat", "verifier")
    line = one_line(info)
    assert line.startswith(f"self-test: the coach did not answer (request failed: cannot connect to {url} (")
    assert "gave up after 1 attempts" in line


def test_a_coach_reply_that_never_parses(coach_at) -> None:  # noqa: ANN001
    server = FaultServer({"default": [reply("Looks fine to me.")]})
    try:
        with pytest.raises(MappaError) as info:
            check_coach(coach_at(server.url).score_many, "mathchat", "verifier")
    finally:
        server.close()
    assert one_line(info).startswith(
        "self-test: the coach's reply did not parse (no PROCESS_SCORE line, also after the follow-up): "
        "'Looks fine to me."
    )
