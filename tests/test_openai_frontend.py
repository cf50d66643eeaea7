"""The OpenAI front end's request mapping, in-process: image content parts become pd_master's `image` input in
their places, and anything but a PNG or JPEG data URL is a 400 naming the part (tests/server/test_openai.py and
tests/server/test_images.py drive a real server)."""

from __future__ import annotations

import pytest

from backends.openai_frontend import IMAGE_PLACEHOLDER, APIError, chat_call


class Template:
    """A chat template that joins each message's content in brackets."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"[{m['role']}: {m['content']}]" for m in messages)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_parts_become_images_in_their_places():
    parts = [{"type": "text", "text": "compare "}, image_part("data:image/png;base64,QUJD"),
             {"type": "text", "text": " and "}, image_part("data:image/jpeg;base64,REVG")]  # fmt: skip
    body = {"messages": [{"role": "user", "content": parts}]}
    call = chat_call(body, Template(), "m")
    assert call.images == [b"QUJD", b"REVG"]
    assert call.text == f"[user: compare {IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}]"


@pytest.mark.parametrize(
    "part,param",
    [
        (image_part("https://example.com/cat.png"), "messages[0].content[1].image_url"),
        (image_part("data:image/gif;base64,R0lG"), "messages[0].content[1].image_url"),
        ({"type": "image_url", "image_url": 7}, "messages[0].content[1].image_url"),
        ({"type": "input_audio", "input_audio": {}}, "messages[0].content[1]"),
    ],
    ids=["http-url", "gif", "not-a-url", "audio"],
)
def test_other_parts_are_a_400_naming_the_part(part, param):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    with pytest.raises(APIError) as e:
        chat_call(body, Template(), "m")
    assert e.value.status == 400 and e.value.param == param
