"""Prompt templates: MindSpeed-RL's named templates and the tokenizer's own chat template.

Runs where: in-process, CPU, no download. The tokenizer is a real HF fast tokenizer (byte-level BPE
trained here, Qwen's ChatML special tokens, a Jinja chat template), saved and reloaded with
AutoTokenizer the way the trainer loads a checkpoint's tokenizer.
"""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mindspeed_rl.config import ConfigError
from mindspeed_rl.data.templates import PromptFormatError, known_prompt_types, render_prompt, render_prompt_with_text

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's structure: a default system turn unless the conversation brings one, ChatML turns.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>system\\nYou are a test assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = ["What is 3 + 4? Put your final answer within \\boxed{}.", "A conversation between User and Assistant.",
          "The reasoning process and answer are enclosed within <think> </think> tags.", "Answer: 7"] * 20


def build_tokenizer(out_dir, *, chat_template=CHAT_TEMPLATE):
    """Train a small byte-level BPE, save it as an HF tokenizer directory, load it with AutoTokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    kwargs = {"chat_template": chat_template} if chat_template else {}
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                            additional_special_tokens=SPECIAL_TOKENS[1:], **kwargs).save_pretrained(str(out_dir))
    return AutoTokenizer.from_pretrained(str(out_dir))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


# MindSpeed-RL configs/model/templates.json, qwen_r1's user slot, written out by hand as the oracle.
QWEN_R1_USER = (
    "<|im_start|>user\nA conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>. Put your final "
    "answer within \\boxed{}.\n{q}<|im_end|>\n<|im_start|>assistant\n"
)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_known_prompt_types_are_chat_and_the_yaml_templates():
    assert known_prompt_types() == ["chat", "empty", "qwen_math_r1", "qwen_r1", "qwen_retool"]


def test_empty_template_is_the_plain_text(tokenizer):
    assert render_prompt("3+4=", tokenizer=tokenizer, prompt_type="empty") == encode(tokenizer, "3+4=")


def test_qwen_r1_renders_mindspeed_rl_text_with_default_system(tokenizer):
    text, ids = render_prompt_with_text("What is 3 + 4?", tokenizer=tokenizer, prompt_type="qwen_r1")
    system_piece = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    user_piece = QWEN_R1_USER.replace("{q}", "What is 3 + 4?")
    assert text == system_piece + user_piece
    # MindSpeed-RL tokenizes each piece on its own and concatenates the ids.
    assert ids == encode(tokenizer, system_piece) + encode(tokenizer, user_piece)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_qwen_math_r1_default_system_is_replaced_by_the_rows_system(tokenizer):
    default = render_prompt_with_text("1+1", tokenizer=tokenizer, prompt_type="qwen_math_r1")[0]
    assert default == ("<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
                       "<|im_end|>\n<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n")
    own = render_prompt_with_text("1+1", tokenizer=tokenizer, prompt_type="qwen_math_r1", system="Be brief.")[0]
    assert own.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1")


def test_chat_equals_the_tokenizers_apply_chat_template_for_a_string(tokenizer):
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}],
                                             add_generation_prompt=True, tokenize=True)["input_ids"]
    assert render_prompt("What is 3 + 4?", tokenizer=tokenizer, prompt_type="chat") == expected


def test_chat_equals_apply_chat_template_for_messages_with_system(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 3 + 4?"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert render_prompt(messages, tokenizer=tokenizer, prompt_type="chat") == expected
    # The same system given through map_keys.system renders identically.
    assert render_prompt(messages[1:], tokenizer=tokenizer, prompt_type="chat", system="Be brief.") == expected


def test_dapo_message_list_with_empty_template_is_the_message_text(tokenizer):
    """DAPO-Math-17k + MindSpeed-RL's `empty`: the user message's content, nothing added."""
    content = "Solve 3 + 4.\n\nRemember to put your answer on its own line after \"Answer:\"."
    prompt = [{"content": content, "role": "user"}]
    assert render_prompt(prompt, tokenizer=tokenizer, prompt_type="empty") == encode(tokenizer, content)


def test_multi_turn_prompt_uses_assistant_format_and_separator(tokenizer):
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    text = render_prompt_with_text(turns, tokenizer=tokenizer, prompt_type="qwen_math_r1", system="S")[0]
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n"
                    "b<|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_template_names_the_known_ones(tokenizer):
    with pytest.raises(ConfigError) as info:
        render_prompt("x", tokenizer=tokenizer, prompt_type="qwen25")
    assert str(info.value).startswith(
        "megatron_training.prompt_type: unknown template 'qwen25'; known: chat, empty, qwen_math_r1, qwen_r1")


def test_chat_without_a_chat_template_is_a_config_error(tmp_path):
    plain = build_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(ConfigError) as info:
        render_prompt("x", tokenizer=plain, prompt_type="chat")
    assert info.value.key == "megatron_training.prompt_type"
    assert str(tmp_path) in info.value.message and "no chat_template" in info.value.message


@pytest.mark.parametrize("prompt", [
    [],
    [{"role": "user"}],
    [{"role": "assistant", "content": "a"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    42,
])
def test_malformed_message_lists_are_rejected(tokenizer, prompt):
    with pytest.raises(PromptFormatError):
        render_prompt(prompt, tokenizer=tokenizer, prompt_type="empty")
