"""A reward of NaN or ±inf is never silent (GRPO, RLOO): it stops the run with one line naming the reward function and
the record, or, with --nonfinite_rewards skip, is left out as not scored (None's treatment) and its share reported
at every logging step as rewards/<name>/nonfinite. Before, a NaN reward zeroed its group's advantages and the run
went on with reward 0 and grad_norm 0, exit 0."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from finetune.methods import rewards
from finetune.models import tiny

ORDERS = Path(__file__).resolve().parents[1] / "finetune" / "apps" / "quickstart_data" / "train.jsonl"
# Even completions score their length, odd ones NaN (the data's 2nd record's first completion, +inf): a function
# that divides by zero somewhere, as a user's may.
NAN_ODD = """import math
def reward(prompts, completions, **kw):
    return [float(len(c)) if i % 2 == 0 else math.nan for i, c in enumerate(completions)]
def infinite(prompts, completions, **kw):
    return [math.inf] * len(completions)
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    model = tiny.build(root / "model", style="chatml")
    data = root / "orders.jsonl"
    data.write_text("".join(ORDERS.read_text().splitlines(keepends=True)[:8]))
    reward = root / "rewards.py"
    reward.write_text(NAN_ODD)
    return root, model, data, reward


def test_the_score_table_stops_or_counts(job):
    reward = job[3]
    where = [f"data.jsonl:{n}" for n in (1, 1, 2, 2)]
    for spec, value, index in ((f"{reward}:reward", "nan", 2), (f"{reward}:infinite", "inf", 1)):
        with pytest.raises(rewards.RewardError) as e:
            rewards.Rewards.of([spec], None).score(["p"] * 4, ["a", "bb", "c", "dd"], [{}] * 4, where=where)
        assert str(e.value).startswith(f"reward {spec} returned {value} for completion {index} of 4 (record "
                                       f"{where[index - 1]}): not a finite number;"), str(e.value)
        assert "--nonfinite_rewards skip" in str(e.value) and "\n" not in str(e.value)
    r = rewards.Rewards.of([f"{reward}:reward", "json_valid"], None, "skip")
    table = r.score(["p"] * 4, ["a", "bb", "c", "{}"], [{}] * 4, where=where)
    assert [row[1] for row in table] == [0.0, 0.0, 0.0, 1.0] and r.skipped == [2, 0]
    assert table[0][0] == 1.0 and table[2][0] == 1.0 and math.isnan(table[1][0]) and math.isnan(table[3][0])


def common(job, out: Path, *flags: str) -> list[str]:
    _, model, data, reward = job
    return ["--method", "grpo", "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out),
            "--reward_funcs", f"{reward}:reward", "--num_generations", "4", "--max_completion_length", "6",
            "--per_device_train_batch_size", "2", "--optim", "sgd", "--learning_rate", "0.5", "--seed", "3",
            "--logging_steps", "1", "--max_steps", "2", *flags]


def test_a_nan_reward_stops_the_run_naming_it_and_the_record(job, isolated, one_thread, tmp_path, capsys):
    from finetune.training import trainer

    with pytest.raises(SystemExit) as e:
        trainer.main(common(job, tmp_path / "o"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    # The first micro-batch: 2 prompts (records of the shuffled data), 4 completions each; the 2nd completion is the
    # first prompt's, named by its file and line.
    lines = re.findall(r"finetune: reward .*", err)
    assert len(lines) == 1 and re.fullmatch(
        re.escape(f"finetune: reward {job[3]}:reward returned nan for completion 2 of 8 (record {job[2]}:") + r"[1-8]"
        + re.escape("): not a finite number; return None for a completion it cannot score, or pass --nonfinite_rewards "
                    "skip to leave such values out (counted in the logs: rewards/<name>/nonfinite)"), lines[0]), err[-3000:]
    assert "Traceback" not in err and not (tmp_path / "o" / "model.safetensors").exists()


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_skip_counts_them_at_every_logging_step(job, isolated, one_thread, tmp_path, method):
    """The loop path, --nonfinite_rewards skip: half the completions are NaN, left out of their groups' baselines;
    the others (their lengths, which differ) train: reward > 0 and grad_norm > 0 at every step, and every step's
    log says rewards/reward/nonfinite 0.5."""
    from finetune.training import loop

    out = tmp_path / method
    flags = common(job, out, "--nonfinite_rewards", "skip")
    flags[1] = method
    loop.main(flags)
    logs = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    assert [e["step"] for e in logs] == [1, 2]
    for e in logs:
        assert e["rewards/reward/nonfinite"] == 0.5, e
        # the mean over the scored half: NaN is out of the mean, as None is
        assert 0 < e["reward"] <= 6 * 4 and e["grad_norm"] > 0, e


def test_the_flag_is_checked_with_the_others(job):
    from finetune import config as C

    root, model, data, reward = job
    with pytest.raises(C.ConfigError) as e:
        C.parse(common(job, root / "x", "--nonfinite_rewards", "skp", "--reward_weights", "nan"))
    assert "nonfinite_rewards: one of stop, skip, got 'skp'; did you mean 'skip'?" in e.value.problems
    assert "reward_weights: every weight must be a finite number, got nan" in e.value.problems
