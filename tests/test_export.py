"""`mappa export`: a run's checkpoint as PEFT adapters or merged models that other tools load, with a model card and
the vLLM line that serves them. Runs are saved with the trainer's own writers (checkpoint, config.yaml, eval
summary) around a tiny policy whose agents have weights of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mappa.cli import main
from mappa.config import dump_config, load_config
from mappa.export import export_run, gain_lines, vllm_lora_rank
from mappa.policy.models import EMBEDDED_HUB_ID, tiny_model_and_tokenizer
from mappa.policy.policy import Policy
from mappa.training.checkpoint import save_checkpoint
from mappa.training.evaluate import write_eval
from mappa.types import Episode, Message, Task
from mappa.workflows import build_workflow

ROOT = Path(__file__).resolve().parents[1]
CHAT = [Message(role="user", content="What is 17 * 23?")]

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]


def make_run(run: Path, *overrides: str, steps: tuple[int, ...] = (3,)) -> Policy:
    """A run directory as the trainer leaves it: config.yaml, checkpoints of `steps`, eval summaries of the start
    and the last step, the gain in metrics.jsonl. Returns the policy of the last checkpoint."""
    cfg = load_config(None, ["model.name=tiny-random", "model.lora_r=4", "model.lora_alpha=8", "name=tiny-team",
                             f"run_dir={run}", *overrides])  # fmt: skip
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(cfg))
    (run / "run.json").write_text('{"mappa_run": 1}')  # marked, as `mappa train` marks it
    agents = build_workflow(cfg).agents
    policy = Policy.from_config(cfg.model, agents, seed=cfg.seed)
    for step in steps:
        with torch.no_grad():  # weights of their own: a fresh adapter (B = 0) is the base itself
            gen = torch.Generator().manual_seed(step)
            for agent in agents:
                for p in policy.trainable_parameters(agent):
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        save_checkpoint(run, step, policy=policy, optimizers={}, state={"cursor": 0})
    write_eval(run / "eval", "start", {"step": 0, "eval/accuracy": 0.25, "eval/tasks": 4.0}, [])
    last = {"step": steps[-1], "eval/accuracy": 0.75, "eval/arithmetic/accuracy": 0.75, "eval/tasks": 4.0}
    write_eval(run / "eval", "final", last, [])
    gain = {"step": steps[-1], "eval/gain": 0.5, "eval/gain_ci_low": 0.1, "eval/gain_ci_high": 0.9}
    (run / "metrics.jsonl").write_text(json.dumps(gain) + "\n")
    return policy


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Policy]:
    run = tmp_path_factory.mktemp("runs") / "lora"
    return run, make_run(run, steps=(2, 3))


def agent_logits(policy: Policy, agent: str) -> torch.Tensor:
    ids = torch.tensor([policy.chat_ids(CHAT)])
    with torch.no_grad(), policy.active(agent) as module:
        return module(input_ids=ids).logits


def loaded_logits(model: torch.nn.Module, policy: Policy) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([policy.chat_ids(CHAT)])).logits


def test_adapters_load_with_peft_and_answer_as_the_agents(lora_run: tuple[Path, Policy], tmp_path: Path) -> None:
    from peft import PeftModel

    run, policy = lora_run
    done = export_run(run, tmp_path / "out")
    assert done.checkpoint.name == "step-000003" and done.step == 3 and not done.merged  # the latest by default
    assert done.dirs == {a: a for a in policy.agents}
    for agent in policy.agents:
        config = json.loads((tmp_path / "out" / agent / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "tiny-random"  # model.name as the user gave it
        loaded = PeftModel.from_pretrained(tiny_model_and_tokenizer(seed=0)[0], str(tmp_path / "out" / agent))
        torch.testing.assert_close(loaded_logits(loaded, policy), agent_logits(policy, agent))
    (line,) = done.serve_lines
    modules = " ".join(f"{a}={(tmp_path / 'out').resolve()}/{a}" for a in policy.agents)
    assert line == f"vllm serve tiny-random --enable-lora --lora-modules {modules} --max-lora-rank 8 --max-loras 3"

    card = (tmp_path / "out" / "README.md").read_text()
    assert card.startswith('---\nbase_model: "tiny-random"\nlibrary_name: "peft"')
    for row in (
        "| `model.lora_r` | `4` |",
        "| `model.agent_weights` | `lora` |",
        "| `workflow.name` | `mathchat` |",
        "| `coach.backend` | `rubric` |",
        "| `eval/accuracy` | 0.75 |",
        "checkpoint `step-000003` (step 3)",
        "Held-out evaluation `final` at step 3:",
        "Accuracy gain over the base: +0.500 (95% interval 0.100",
    ):
        assert row in card, row  # fmt: skip
    modules = " ".join(f"{a}=./{a}" for a in policy.agents)
    assert f"vllm serve tiny-random --enable-lora --lora-modules {modules} --max-lora-rank 8" in card


def test_merged_models_reload_with_transformers_and_match_the_agents(
    lora_run: tuple[Path, Policy], tmp_path: Path
) -> None:
    """Through the command line, an older checkpoint chosen by name: `mappa export RUN --checkpoint step-000002
    --out DIR --merge` prints the serve lines on stdout; each merged model equals its agent."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, _ = lora_run
    out = tmp_path / "merged"
    cmd = [sys.executable, "-m", "mappa.cli", "export", str(run), "--checkpoint", "step-000002", "--out", str(out)]
    proc = subprocess.run([*cmd, "--merge"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    at_two = Policy.from_checkpoint(run / "checkpoints" / "step-000002" / "policy", device="cpu")
    lines = proc.stdout.splitlines()
    assert len(lines) == len(at_two.agents)  # one server per merged model
    for port, (agent, line) in enumerate(zip(at_two.agents, lines, strict=True), start=8000):
        assert line == f"vllm serve {out.resolve()}/{agent} --served-model-name {agent} --port {port}"
        model = AutoModelForCausalLM.from_pretrained(out / agent)
        assert not any(".lora_" in n for n, _ in model.named_parameters())  # merged, not an adapter
        torch.testing.assert_close(loaded_logits(model, at_two), agent_logits(at_two, agent), rtol=1e-5, atol=1e-5)
        tokenizer = AutoTokenizer.from_pretrained(out / agent)
        text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT[0].content}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == at_two.chat_ids(CHAT)
    card = (out / "README.md").read_text()
    assert 'library_name: "transformers"' in card and "(the checkpoint, step 2, was not evaluated)" in card


def test_shared_exports_the_one_adapter_and_full_exports_whole_models(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    shared = make_run(tmp_path / "shared", "model.agent_weights=shared")
    done = export_run(tmp_path / "shared", tmp_path / "shared-out")
    assert set(done.dirs.values()) == {"shared"} and sorted(p.name for p in (tmp_path / "shared-out").iterdir()) == [
        "README.md", "shared"]  # fmt: skip
    assert all(f"{a}={(tmp_path / 'shared-out').resolve()}/shared" in done.serve_lines[0] for a in shared.agents)

    full = make_run(tmp_path / "full", "model.agent_weights=full")
    done = export_run(tmp_path / "full", tmp_path / "full-out")
    assert done.merged and done.dirs == {a: a for a in full.agents}
    for agent in full.agents:
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "full-out" / agent)
        torch.testing.assert_close(loaded_logits(model, full), agent_logits(full, agent))


def test_the_embedded_base_is_named_by_its_hub_id(tmp_path: Path) -> None:
    """A run on the embedded SmolLM2 (saved here around the tiny model: copying adapters loads no base)."""
    run = tmp_path / "embedded"
    cfg = load_config(None, ["model.lora_r=16", f"run_dir={run}"])
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    (run / "run.json").write_text('{"mappa_run": 1}')
    model, tokenizer = tiny_model_and_tokenizer()
    policy = Policy.from_model(model, tokenizer, ["solver"], base_name=cfg.model.name, lora_r=16)
    save_checkpoint(run, 1, policy=policy, optimizers={}, state={"cursor": 0})
    done = export_run(run, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "solver" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == EMBEDDED_HUB_ID
    assert done.serve_lines[0].startswith(f"vllm serve {EMBEDDED_HUB_ID} --enable-lora --lora-modules solver=")
    assert "--max-lora-rank 16" in done.serve_lines[0]
    card = (tmp_path / "out" / "README.md").read_text()
    assert f'base_model: "{EMBEDDED_HUB_ID}"' in card and "No evaluation recorded" in card
    assert [vllm_lora_rank(r) for r in (1, 8, 9, 300, 1024)] == [8, 8, 16, 320, 1024]
    exported = load_file(tmp_path / "out" / "solver" / "adapter_model.safetensors")
    saved = load_file(run / "checkpoints" / "step-000001" / "policy" / "adapters" / "agent_solver" /
                      "adapter_model.safetensors")  # fmt: skip
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)


def test_bad_input_is_one_line(lora_run: tuple[Path, Policy], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run, _ = lora_run
    (tmp_path / "not-a-run").mkdir()
    (tmp_path / "untrained").mkdir()
    (tmp_path / "untrained" / "config.yaml").write_text((run / "config.yaml").read_text())
    (tmp_path / "untrained" / "run.json").write_text((run / "run.json").read_text())
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = {
        (str(tmp_path / "nope"), "--out", str(tmp_path / "o1")): "run directory not found",
        (str(tmp_path / "not-a-run"), "--out", str(tmp_path / "o2")): "not a mappa run directory (no run.json",
        (str(tmp_path / "untrained"), "--out", str(tmp_path / "o3")): "no complete checkpoint under",
        (str(run), "--checkpoint", "step-000009", "--out", str(tmp_path / "o4")): "--checkpoint step-000009: neither",
        (str(run), "--out", str(tmp_path / "full")): "exists and is not empty",
    }
    for args, message in cases.items():
        assert main(["export", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("mappa: error: ") and message in err and "\n" not in err, err
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3", "o4"))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind
    assert main(["export", str(run), "--out", str(tmp_path / "o5"), "--push-to-hub", "bad repo//id"]) == 2
    assert "--push-to-hub bad repo//id: not a repository id" in capsys.readouterr().err
    assert not (tmp_path / "o5").exists()


def test_push_to_hub_without_a_login_fails_before_any_work(lora_run: tuple[Path, Policy], tmp_path: Path) -> None:
    run, _ = lora_run
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env |= {"HF_HOME": str(tmp_path / "hf-home"), "OMP_NUM_THREADS": "1"}  # no stored token either
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mappa.cli", "export", str(run), "--out", str(out), "--push-to-hub", "me/team"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "mappa: error: --push-to-hub me/team: not logged in to the Hugging Face Hub (hf auth login, or set HF_TOKEN)"
    )
    assert not out.exists()


def test_a_trained_run_exports_with_the_template_variables_it_trained_with(tmp_path: Path) -> None:
    """`mappa.training.trainer.train` on a saved tiny model whose template reads enable_thinking: every trained prompt
    has the template's no-thinking block, and the export's card and serve line carry the setting."""
    from helpers import save_tiny, tiny_cfg

    from mappa.training.tracking import new_run_dir
    from mappa.training.trainer import train
    from mappa.types import Episode, read_jsonl

    model_dir = save_tiny(tmp_path / "model")
    setting = "generation.chat_template_kwargs.enable_thinking=false"
    cfg = tiny_cfg(tmp_path, f"model.name={model_dir}", setting, "train.steps=1", "logging.report_to=[]")
    run = new_run_dir(cfg)  # config.yaml and run.json, as `mappa train` starts a run
    train(cfg, run)
    tokenizer = tiny_model_and_tokenizer()[1]
    prompts = [a.prompt_ids for e in read_jsonl(run / "episodes.jsonl", Episode) for a in e.actions]
    assert prompts and all(tokenizer.decode(p).endswith("<think>\n\n</think>\n\n") for p in prompts)

    done = export_run(run, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "problem_solver" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dir)
    assert done.serve_lines[0].endswith("""--default-chat-template-kwargs '{"enable_thinking": false}'""")
    card = (tmp_path / "out" / "README.md").read_text()
    assert '| `generation.chat_template_kwargs` | `{"enable_thinking": false}` |' in card
    assert "Held-out evaluation `final` at step 1:" in card


def test_the_card_gain_counts_each_task_once(tmp_path: Path) -> None:
    """Eight tasks, four samples each, two more right after: the card's interval is the one over 8 tasks, not 32
    independent episodes (which would call it beyond noise), whatever metrics.jsonl logged."""
    tasks = [Task(id=f"t{i}", problem="p", answer="1", source="arithmetic") for i in range(8)]

    def samples(right: int) -> list[Episode]:
        return [Episode(id=f"{t.id}-{j}", workflow="w", task=t, correct=i < right) for i, t in enumerate(tasks)
                for j in range(4)]  # fmt: skip

    write_eval(tmp_path / "eval", "start", {"step": 0}, samples(2))
    write_eval(tmp_path / "eval", "final", {"step": 3}, samples(4))
    logged = {"eval/gain": 0.25, "eval/gain_ci_low": 0.1, "eval/gain_ci_high": 0.4}
    (line,) = [x for x in gain_lines(tmp_path, "final", logged) if x]
    assert line.startswith("Accuracy gain over the base (`start` to `final`): +0.250 (95% interval -0.")
    assert "paired by task, t on 8 per-task differences, 32 episodes" in line
    assert (
        gain_lines(tmp_path, "../final", logged)[-1]
        == "Accuracy gain over the base: +0.250 (95% interval 0.100 to 0.400)."
    )
