"""A checkpoint's chat template is found where the installed transformers' `save_pretrained`
puts it (chat_template.jinja now, tokenizer_config.json with `save_jinja_files=False`, the
default of several templates), renders as transformers renders it, and a checkpoint without one
says so at start-up and in the chat endpoint's 404."""

from __future__ import annotations

import logging

import pytest

from examples.engine.chat_template import JINJA_FILE, read_chat_template
from examples.engine.tokenizer import HFTokenizer
from tests.support.checkpoints import CHAT_TEMPLATE, write_checkpoint

transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
TOOL_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{% endfor %}"


def saved_by_transformers(path, chat_template, **save_kwargs):
    """A checkpoint whose tokenizer transformers itself saved (over write_checkpoint's files)."""
    write_checkpoint(path, chat_template=None)
    (path / "tokenizer_config.json").unlink()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(path / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path, **save_kwargs)
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("save_jinja_files, source", [(True, JINJA_FILE),
                                                      (False, "tokenizer_config.json")])
def test_the_template_is_read_where_transformers_saved_it(tmp_path, save_jinja_files, source):
    reference = saved_by_transformers(tmp_path, CHAT_TEMPLATE, save_jinja_files=save_jinja_files)
    assert (tmp_path / JINJA_FILE).exists() == save_jinja_files
    ours = HFTokenizer.from_dir(tmp_path, {})
    assert read_chat_template(tmp_path, ours.config).source == source
    assert ours.render_chat(MESSAGES) == reference.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


def test_of_several_templates_the_default_one_serves(tmp_path):
    reference = saved_by_transformers(tmp_path, {"default": CHAT_TEMPLATE,
                                                 "tool_use": TOOL_TEMPLATE})
    ours = HFTokenizer.from_dir(tmp_path, {})
    assert ours.chat_template == CHAT_TEMPLATE
    assert ours.render_chat(MESSAGES) == reference.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


def test_a_template_file_wins_over_the_config_entry(tmp_path):
    saved_by_transformers(tmp_path, CHAT_TEMPLATE)
    config = {"chat_template": TOOL_TEMPLATE}  # what an older save left in the config
    assert read_chat_template(tmp_path, config).text == CHAT_TEMPLATE


def test_a_checkpoint_without_a_template_says_chat_is_off(tmp_path, caplog):
    saved_by_transformers(tmp_path, None)
    with caplog.at_level(logging.WARNING, logger="examples.engine.chat_template"):
        tokenizer = HFTokenizer.from_dir(tmp_path, {})
    assert tokenizer.chat_template is None
    assert "no chat template" in caplog.text and JINJA_FILE in caplog.text
    assert "/v1/chat/completions is off" in caplog.text


def test_an_unreadable_legacy_file_is_named(tmp_path):
    write_checkpoint(tmp_path, chat_template=None)
    (tmp_path / "chat_template.json").write_text('{"template": "x"}')
    with pytest.raises(ValueError, match="chat_template.json is not"):
        read_chat_template(tmp_path, {})


def test_a_processors_legacy_file_comes_before_the_config(tmp_path):
    # transformers' processors read chat_template.json as {"chat_template": ...}
    # (processing_utils); no tokenizer class writes it, so it is written here in that form.
    write_checkpoint(tmp_path, chat_template=TOOL_TEMPLATE)
    (tmp_path / "chat_template.json").write_text('{"chat_template": "%s"}' % "{{ 'legacy' }}")
    tokenizer = HFTokenizer.from_dir(tmp_path, {})
    assert tokenizer.render_chat(MESSAGES) == "legacy"
