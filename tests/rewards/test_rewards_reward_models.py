"""RewardModel: a one-output sequence-classification model used as a reward, by path or as an object."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from cohort.models import build_tiny_tokenizer
from cohort.rewards import RewardModel, resolve_reward_funcs, reward_name, reward_weights, score

PROMPTS = ["12+30=", "12+30=", "7+8=", "7+8="]
COMPLETIONS = ["42", "4", "15 is the sum", ""]


def _classifier(num_labels: int = 1, seed: int = 0) -> Qwen2ForSequenceClassification:
    """Returns a tiny random Qwen2 sequence classifier over the tiny tokenizer's vocabulary."""
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=num_labels,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForSequenceClassification(config).eval()
    with torch.no_grad():  # a visible score head: random init alone gives near-equal tiny scores
        model.score.weight.normal_(0, 1.0)
    return model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """Returns the folder of a tiny reward model (num_labels=1) and its tokenizer, saved with save_pretrained."""
    folder = tmp_path_factory.mktemp("reward") / "tiny-rm"
    _classifier().save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


def _direct_scores(model, tokenizer, texts):
    """Returns logits[:, 0] of each text run alone (no padding), the reference for the batched scores."""
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


def test_by_path_scores_equal_a_direct_forward_pass(reward_model_dir):
    (rm,) = resolve_reward_funcs(str(reward_model_dir))
    assert isinstance(rm, RewardModel) and reward_name(rm) == "tiny-rm"
    got = rm(prompts=PROMPTS, completions=COMPLETIONS)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert rm.texts(PROMPTS, COMPLETIONS) == texts
    reference = Qwen2ForSequenceClassification.from_pretrained(reward_model_dir).eval()
    expected = _direct_scores(reference, build_tiny_tokenizer(), texts)
    assert got == pytest.approx(expected, abs=1e-5)
    assert len(set(round(x, 4) for x in got)) == 4  # the texts get different scores
    small = RewardModel(reward_model_dir, batch_size=3)  # a path object, batches of 3 then 1
    assert small(PROMPTS, COMPLETIONS) == pytest.approx(got, abs=1e-5)
    out = score([rm], prompts=PROMPTS, completions=COMPLETIONS)
    assert out[:, 0].tolist() == pytest.approx(got, abs=1e-6)


def test_as_an_object_with_its_tokenizer(reward_model_dir):
    model = Qwen2ForSequenceClassification.from_pretrained(reward_model_dir)
    tokenizer = build_tiny_tokenizer()
    (rm,) = resolve_reward_funcs([model], reward_processing_classes=[tokenizer])
    assert rm.model is model and rm.tokenizer is tokenizer and reward_name(rm) == "tiny-rm"
    assert reward_weights(None, [model]).tolist() == [1.0]  # a spec list with a model counts it
    expected = _direct_scores(model, tokenizer, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert rm(PROMPTS, COMPLETIONS) == pytest.approx(expected, abs=1e-5)
    (own,) = resolve_reward_funcs(model)  # one model alone; its tokenizer loaded from its folder
    assert own.tokenizer is not tokenizer and own(PROMPTS, COMPLETIONS) == pytest.approx(expected, abs=1e-5)
    assert rm.to("cpu") is rm and rm.device == torch.device("cpu")


def test_conversational_texts_use_the_chat_template(reward_model_dir):
    rm = RewardModel(reward_model_dir)
    prompts = [[{"role": "user", "content": "7+8="}]] * 2
    completions = [[{"role": "assistant", "content": "15"}], "16"]
    texts = rm.texts(prompts, completions)
    assert texts == ["User: 7+8=\nAssistant: 15<|endoftext|>\n", "User: 7+8=\nAssistant: 16<|endoftext|>\n"]
    expected = _direct_scores(rm.model, rm.tokenizer, texts)
    assert rm(prompts, completions) == pytest.approx(expected, abs=1e-5)
    bare = build_tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="has no chat template, which conversational prompts need"):
        RewardModel(rm.model, bare)(prompts, completions)


def test_wrong_num_labels_is_refused(tmp_path, tiny_model_dir):
    folder = tmp_path / "classifier"
    _classifier(num_labels=3).save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    with pytest.raises(ValueError, match=r"'.*classifier' has a head with num_labels=3; .*\(num_labels=1\)"):
        resolve_reward_funcs(str(folder))
    with pytest.raises(ValueError, match="has a head with num_labels=2"):
        RewardModel(_classifier(num_labels=2), build_tiny_tokenizer())
    # a causal LM's folder: it has no score head at all (num_labels=2 is transformers' default), and says so
    with pytest.raises(
        ValueError, match=r"is a causal language model \(Qwen2ForCausalLM\), not a reward model"
    ):
        resolve_reward_funcs(str(tiny_model_dir))


def test_pad_token_falls_back_to_eos_and_a_tokenizer_without_either_is_refused(reward_model_dir):
    model = Qwen2ForSequenceClassification.from_pretrained(reward_model_dir)
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    rm = RewardModel(model, tokenizer)
    assert tokenizer.pad_token == tokenizer.eos_token and model.config.pad_token_id == tokenizer.eos_token_id
    assert len(rm(PROMPTS, COMPLETIONS)) == 4
    tokenizer = build_tiny_tokenizer()
    tokenizer.pad_token = None
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="has neither a pad token nor an eos token"):
        RewardModel(model, tokenizer)


def test_bad_construction():
    with pytest.raises(ValueError, match="was built in memory and has no name_or_path"):
        RewardModel(_classifier())
    with pytest.raises(ValueError, match="batch_size=0 must be a positive integer"):
        RewardModel(_classifier(), build_tiny_tokenizer(), batch_size=0)
    with pytest.raises(TypeError, match="RewardModel needs a folder, a hub id or a transformers model"):
        RewardModel(torch.nn.Linear(2, 1))  # type: ignore[arg-type]


def test_trainer_learns_from_a_reward_model_by_path(tiny_model_dir, reward_model_dir, tmp_path):
    from test_trainer import _cfg, _params

    from cohort.trainer import GRPOTrainer

    cfg = _cfg(tiny_model_dir, tmp_path / "run", steps=2, rewards=[str(reward_model_dir)])
    t = GRPOTrainer(cfg)
    assert isinstance(t.reward_funcs[0], RewardModel) and t.reward_names == ["tiny-rm"]
    before = _params(t.model)
    t.train()
    after = _params(t.model)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the policy did not change"
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["rewards/tiny-rm/std"] > 0 for m in metrics)


def test_one_loader_for_scoring_and_for_training(tiny_model_dir, reward_model_dir):
    from cohort.rewards.reward_models import load_score_model

    # Scoring reads a reward model as it is; training may start from a causal LM and give it a new head.
    assert load_score_model(reward_model_dir).config.num_labels == 1
    with pytest.raises(ValueError, match="is a causal language model .*not a reward model"):
        load_score_model(tiny_model_dir)
    model = load_score_model(tiny_model_dir, new_head=True)
    assert type(model).__name__ == "Qwen2ForSequenceClassification" and model.config.num_labels == 1


def test_a_text_past_a_learned_position_table_is_a_clear_error_not_a_device_assert():
    """GPT-2-like reward models look positions up in a table: past its end the lookup fails, on a GPU as a
    device-side assert that ends the process's CUDA. It is refused before the forward; rotary models still score."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    tokenizer = build_tiny_tokenizer()
    gpt2 = GPT2ForSequenceClassification(
        GPT2Config(
            vocab_size=len(tokenizer), n_positions=8, n_embd=16, n_layer=1, n_head=2, num_labels=1,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()  # fmt: skip
    rm = RewardModel(gpt2, tokenizer)
    assert len(rm(["1+1="], ["2"])) == 1  # a short text fits
    long = "12345678901234567890"
    with pytest.raises(
        ValueError, match=r"reads at most 8 tokens \(max_position_embeddings\) and a text to score has"
    ):
        rm([long], [long])
    rotary = _classifier()
    rotary.config.max_position_embeddings = (
        8  # a rotary model has no table: it scores past its nominal length
    )
    assert len(RewardModel(rotary, tokenizer)([long], [long])) == 1
