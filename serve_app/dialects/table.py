"""The dialects the ingress serves: one row each (serve_app/schema/dialect.py says what a
row holds). A new dialect is its module, which builds its row, and one line here."""

from __future__ import annotations

from serve_app.dialects.chat.route import CHAT
from serve_app.dialects.completions import COMPLETIONS
from serve_app.dialects.lm_v2 import LM_V2
from serve_app.dialects.messages.route import MESSAGES
from serve_app.dialects.responses.route import RESPONSES
from serve_app.schema.dialect import Dialect

DIALECTS: tuple[Dialect, ...] = (
    CHAT,  # /v1/chat/completions
    LM_V2,  # /lm/v2/chat/completions
    COMPLETIONS,  # /v1/completions
    RESPONSES,  # /v1/responses
    MESSAGES,  # /v1/messages (Anthropic's)
)
