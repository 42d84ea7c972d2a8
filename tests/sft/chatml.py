"""The demo's ChatML rendering for tests that need a prompt the way the model was trained on it, done by jinja2
with the settings Hugging Face's apply_chat_template uses (not by the ChatTokenizer under test)."""
from runtime.sft.synthetic import CHAT_TEMPLATE


def render_chatml(messages, add_generation_prompt=False) -> str:
    import jinja2

    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt)
