"""`/v1/messages` (Anthropic's Messages API): request, chat translation, content blocks and
events, errors in Anthropic's shape, and its row of the dialect table (route.py)."""
