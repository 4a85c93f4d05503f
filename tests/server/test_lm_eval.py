"""lm-evaluation-harness scores a multiple-choice task through our server by loglikelihood
(``local-completions``: echo + logprobs over the prompt) and the scores equal those of its HF
backend on the same weights. The task ships in ``lm_eval_tasks/`` (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.server.conftest import live_server

TASKS = Path(__file__).parent / "lm_eval_tasks"
TASK = "pagedllm_tiny_mc"


def evaluate(model: str, model_args: dict, monkeypatch) -> dict[str, float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASKS)  # the task's data_files are relative to it
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                                  task_manager=TaskManager(include_path=str(TASKS)), log_samples=False)
    res = out["results"][TASK]
    return {"acc": res["acc,none"], "acc_norm": res["acc_norm,none"]}


def test_parse_logprobs_reads_our_echo_shape():
    """lm-eval's own parser over a completion shaped by our server: the continuation's logprobs sum,
    and greediness is read from the top_logprobs dicts."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from pagedllm.server.echo_logprobs import prompt_completion_logprobs

    text = {1: "Q", 2: ":", 3: " A", 4: " B"}.get
    lp = prompt_completion_logprobs([1, 2, 3, 4], [None, {2: -0.5, 9: -1.0}, {3: -2.0, 4: -0.1}, {4: -0.3}], text)
    assert lp.tokens == ["Q", ":", " A", " B"] and lp.token_logprobs == [None, -0.5, -2.0, -0.3]
    assert lp.top_logprobs[0] is None and lp.text_offset == [0, 1, 2, 4]
    choice = {"index": 0, "logprobs": {k: v + [0.0] for k, v in lp.model_dump().items()}}  # + 1 generated token
    (score, greedy), = LocalCompletionsAPI.parse_logprobs({"choices": [choice]}, ctxlens=[2])
    assert score == pytest.approx(-2.3) and greedy is False


@pytest.mark.slow
def test_scores_through_server_equal_hf_backend(smollm2_dir, monkeypatch):
    with live_server() as srv:
        import openai

        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0)
        probe = client.completions.create(prompt="Question: Answer:", max_tokens=1, echo=True, logprobs=1,
                                          model=srv.engine.model_name)  # fails fast, before lm-eval retries
        assert probe.choices[0].logprobs.token_logprobs[0] is None
        monkeypatch.setenv("OPENAI_API_KEY", srv.api_key)
        ours = evaluate("local-completions", {
            "base_url": f"{srv.url}/v1/completions", "model": srv.engine.model_name,
            "tokenizer_backend": "huggingface", "tokenizer": smollm2_dir, "tokenized_requests": True,
            "num_concurrent": 2, "max_retries": 1, "batch_size": 16}, monkeypatch)
    hf = evaluate("hf", {"pretrained": smollm2_dir, "dtype": "float32", "device": "cpu", "batch_size": 16},
                  monkeypatch)
    assert ours == pytest.approx(hf, abs=1e-9)
    assert 0.25 < hf["acc"] < 1.0, hf  # the task discriminates: better than chance, not trivial
