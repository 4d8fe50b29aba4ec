"""chat_template_kwargs (Api._template_kwargs): variables for the chat template, never the
arguments the server sets when it applies the template."""

from __future__ import annotations

import pytest

from ddtree.engine.reference.api import Api, BadRequest


@pytest.mark.parametrize("key", ["add_generation_prompt", "tokenize", "chat_template", "tools",
                                 # the conversation as the template renders it, and transformers'
                                 # other apply_chat_template arguments: these raised in there, and
                                 # the 400 blamed "these messages"
                                 "messages", "conversations", "return_assistant_tokens_mask",
                                 "sanitize_control_tokens", "tokenizer_kwargs"])
def test_an_argument_the_server_sets_is_refused_by_name(key):
    with pytest.raises(BadRequest, match=f"chat_template_kwargs may not set {key}"):
        Api._template_kwargs({key: True})


def test_template_variables_pass_through():
    assert Api._template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    assert Api._template_kwargs(None) == {}
    with pytest.raises(BadRequest, match="must be an object"):
        Api._template_kwargs(["enable_thinking"])
