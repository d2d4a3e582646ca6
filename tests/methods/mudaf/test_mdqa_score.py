"""MDQA retrieval scores: per-passage masses equal eager attention, F1/EM as MuDAF defines them,
clear errors, and the `retmask mdqa-score` command end to end on a tiny model."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers

import retmask
from retmask.cli import main as cli_main
from retmask.heads.selection import load_scores
from retmask.methods.mudaf.mdqa import MDQAError, Passage, build_prompt, write_mdqa
from retmask.methods.mudaf.score import MDQAScoreConfig, f1_em, score_mdqa
from tests.hf.conftest import tiny_config
from tests.hf.test_attention_features import FEATURE_ARCHS
from tests.tiny import tiny_llama_for


def eager_masses(model, tokenizer, example) -> torch.Tensor:
    """float [L, Hq, P] from the full eager attention matrices (output_attentions)."""
    pr = build_prompt(example, tokenizer, include_answer=False)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([pr.input_ids]), output_attentions=True, use_cache=False)
    last = torch.stack([a[0, :, -1] for a in out.attentions])  # [L, Hq, N]
    return torch.stack([last[:, :, s:e].sum(-1) for s, e in pr.passage_spans], dim=-1)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_masses_equal_eager_attention(mdqa_examples, bpe_tokenizer, batch_size):
    examples = mdqa_examples[:6]
    model = tiny_llama_for(bpe_tokenizer)
    eager = tiny_llama_for(bpe_tokenizer, attn="eager")
    scores = score_mdqa(
        model, bpe_tokenizer, examples, MDQAScoreConfig(batch_size=batch_size), progress=False
    )
    assert scores.f1.shape == (6, 2, 4) and scores.em.shape == (6, 2, 4)
    for e, ex in enumerate(examples):
        ref = eager_masses(eager, bpe_tokenizer, ex)
        assert scores.masses[e].shape == tuple(ref.shape)
        np.testing.assert_allclose(scores.masses[e], ref.numpy(), atol=2e-5)
        # F1 / EM follow from the masses (checked against the eager masses through the same rule).
        f1, em = f1_em(ref, ex.golden_indices, scores.config.epsilon)
        np.testing.assert_array_equal(scores.em[e], em.numpy())
        np.testing.assert_allclose(scores.f1[e], f1.numpy(), atol=1e-12)
    assert (scores.passage_mass <= 1 + 1e-5).all() and (
        scores.golden_mass <= scores.passage_mass + 1e-6
    ).all()
    # Real data spread: the masses are not degenerate (some head prefers some passage).
    assert scores.passage_mass.max() > 0.1


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text", "gpt_oss"])
def test_masses_follow_sliding_window_softcap_and_sinks(mdqa_examples, bpe_tokenizer, arch):
    """A local layer's last row sees only its window (5 keys here, far shorter than the prompts); Gemma 2
    caps its logits; gpt-oss's sinks take mass from every key: the masses still equal eager attention's."""
    torch.manual_seed(0)
    config = tiny_config(
        arch, **FEATURE_ARCHS[arch], vocab_size=len(bpe_tokenizer), max_position_embeddings=4096,
        pad_token_id=bpe_tokenizer.pad_token_id, bos_token_id=bpe_tokenizer.eos_token_id,
        eos_token_id=bpe_tokenizer.eos_token_id,
    )  # fmt: skip
    eager = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    if arch == "gpt_oss":  # sinks start near zero; make them matter
        with torch.no_grad():
            for layer in retmask.hf.head_layout(eager).layers:
                layer.sinks.normal_(0.0, 2.0)
    model = retmask.patch(copy.deepcopy(eager))
    examples = mdqa_examples[:3]
    scores = score_mdqa(model, bpe_tokenizer, examples, MDQAScoreConfig(batch_size=3), progress=False)
    for e, ex in enumerate(examples):
        ref = eager_masses(eager, bpe_tokenizer, ex)
        np.testing.assert_allclose(scores.masses[e], ref.numpy(), atol=2e-5)
    # The window bites: the local layer 0 puts (almost) no mass on passages far from the question.
    assert scores.passage_mass[:, 0].max() < scores.passage_mass[:, 1].max()


def test_f1_em_definitions():
    m = torch.tensor([0.5, 0.1, 0.35, 0.05])
    f1, em = f1_em(m, [0, 2], 0.3)  # attended {0, 2} = golden
    assert f1.item() == 1.0 and em.item() == 1.0
    f1, em = f1_em(m, [0, 1], 0.3)  # attended {0, 2}: P = R = 1/2; top-2 {0, 2} != {0, 1}
    assert f1.item() == pytest.approx(0.5) and em.item() == 0.0
    f1, em = f1_em(m, [1], 0.3)  # nothing golden attended
    assert f1.item() == 0.0 and em.item() == 0.0
    f1, em = f1_em(m, [0], 0.6)  # nothing attended at all: F1 = 0 by convention, EM ignores ε
    assert f1.item() == 0.0 and em.item() == 1.0
    f1, _ = f1_em(m, [2], 0.3)  # attended {0, 2}, golden {2}: P = 1/2, R = 1
    assert f1.item() == pytest.approx(2 * 0.5 * 1 / 1.5)


def test_bad_examples_name_the_example(mdqa_examples, bpe_tokenizer):
    model = tiny_llama_for(bpe_tokenizer)
    good = mdqa_examples[0]
    wrong_gold = dataclasses.replace(good, id="bad-gold", golden_ids=["nope"])
    with pytest.raises(MDQAError, match="bad-gold.*golden ids"):
        score_mdqa(model, bpe_tokenizer, [good, wrong_gold], progress=False)
    empty = [Passage(p.id, p.title, "  " if i == 1 else p.text) for i, p in enumerate(good.passages)]
    with pytest.raises(MDQAError, match="empty-pass.*empty text"):
        score_mdqa(
            model, bpe_tokenizer, [dataclasses.replace(good, id="empty-pass", passages=empty)], progress=False
        )
    with pytest.raises(MDQAError, match=f"{good.id}.*context limit of 20"):
        score_mdqa(model, bpe_tokenizer, [good], MDQAScoreConfig(max_length=20), progress=False)
    with pytest.raises(MDQAError, match="epsilon"):
        score_mdqa(model, bpe_tokenizer, [good], MDQAScoreConfig(epsilon=1.5), progress=False)


def test_command_end_to_end(tmp_path, mdqa_examples, bpe_tokenizer, capsys):
    folder = tmp_path / "tiny"
    tiny_llama_for(bpe_tokenizer).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    data = write_mdqa(mdqa_examples[:5], tmp_path / "mdqa.jsonl")
    out = tmp_path / "scores.json"
    rc = cli_main(["mdqa-score", "--data", str(data), "--model", str(folder), "--out", str(out),
                   "--plot", str(tmp_path / "h.png"), "--batch-size", "2", "--epsilon", "0.2", "--answers", "--masses"])  # fmt: skip
    assert rc == 0
    scores = load_scores(out)
    assert len(scores) == 8  # 2 layers x 4 heads
    record = json.loads((tmp_path / "scores.run.json").read_text())
    assert record["config"]["epsilon"] == 0.2 and record["examples"] == 5
    for key, mean in record["mean_f1"].items():
        assert mean == pytest.approx(scores[tuple(int(x) for x in key.split("-"))], abs=1e-5)
    assert (tmp_path / "h.png").stat().st_size > 0
    npz = np.load(tmp_path / "scores.masses.npz")
    assert npz["masses_0"].shape == (2, 4, len(mdqa_examples[0].passages))
    assert npz["golden"][0] == ",".join(map(str, mdqa_examples[0].golden_indices))
    answers = record["answers"]
    assert len(answers["outputs"]) == 5
    assert answers["accuracy"] == sum(r["correct"] for r in answers["outputs"]) / 5
    assert "top heads" in capsys.readouterr().out
    # the finished run's outputs are not replaced without --overwrite
    rc = cli_main(["mdqa-score", "--data", str(data), "--model", str(folder), "--out", str(out)])
    assert rc == 2 and "already exist; pass --overwrite" in capsys.readouterr().err
    rc = cli_main(
        ["mdqa-score", "--data", str(tmp_path / "missing.jsonl"), "--model", str(folder), "--out", str(out),
         "--overwrite"]
    )  # fmt: skip
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_command_resumes_an_interrupted_run(tmp_path, mdqa_examples, bpe_tokenizer, monkeypatch, capsys):
    """Ctrl-C while the last of 3 batches is being kept (5 of 6 examples in <out>.progress/): the resume
    scores only the 6th and writes what the uninterrupted run writes; other settings, a missing or damaged
    progress folder and a new run over an unfinished one are refused by name."""
    from retmask.methods.mudaf.score_progress import ScoreProgress, progress_dir

    folder = tmp_path / "tiny"
    tiny_llama_for(bpe_tokenizer).save_pretrained(folder)
    bpe_tokenizer.save_pretrained(folder)
    data = write_mdqa(mdqa_examples[:6], tmp_path / "mdqa.jsonl")

    def command(out, *extra):
        return cli_main(["mdqa-score", "--data", str(data), "--model", str(folder), "--out", str(out),
                         "--batch-size", "2", "--epsilon", "0.2", "--no-progress", *extra])  # fmt: skip

    assert command(tmp_path / "whole.json") == 0
    want = json.loads((tmp_path / "whole.json").read_text())

    saved, save = [], ScoreProgress.save

    def save_then_interrupt(self, index, example_id, masses):
        save(self, index, example_id, masses)
        saved.append(index)
        if len(saved) == 5:  # in the 3rd batch: its first example is kept, the batch is not finished
            raise KeyboardInterrupt

    monkeypatch.setattr(ScoreProgress, "save", save_then_interrupt)
    out = tmp_path / "scores.json"
    assert command(out) == 130
    assert "interrupted; continue with the same command plus --resume" in capsys.readouterr().err
    progress = progress_dir(out)
    assert not out.exists() and len(list(progress.glob("*.json"))) == 1 + 5  # settings + 5 examples

    assert command(out) == 2  # a new run over the unfinished one
    assert "pass --resume to continue or --overwrite" in capsys.readouterr().err
    assert command(out, "--resume", "--batch-size", "1") == 2  # other settings
    assert "batch_size: 2 -> 1" in capsys.readouterr().err
    first = sorted(progress.glob("[0-9]*.json"))[0]
    kept = first.read_text()
    first.write_text(kept.replace('"masses": [[[', '"masses": [[["x", '))
    assert command(out, "--resume") == 2
    assert f"progress file {first}: 'masses' must be nested lists" in capsys.readouterr().err
    first.write_text(kept)

    saved.clear()
    monkeypatch.setattr(ScoreProgress, "save", lambda self, *a: saved.append(a[0]) or save(self, *a))
    assert command(out, "--resume") == 0
    assert len(saved) == 1  # only the example the interrupted run had not kept
    assert (
        "6 examples" in (printed := capsys.readouterr().out) and "5 scored by the interrupted run" in printed
    )
    assert json.loads(out.read_text()) == want
    record = json.loads((tmp_path / "scores.run.json").read_text())
    whole = json.loads((tmp_path / "whole.run.json").read_text())
    assert record["mean_f1"] == whole["mean_f1"] and record["resumed_examples"] == 5
    assert not progress.exists()  # finished: nothing left to resume
    assert command(out, "--resume") == 2
    assert "there is no interrupted run" in capsys.readouterr().err
