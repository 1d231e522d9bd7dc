"""`/v1/responses` (OpenAI's Responses API): request, chat translation, output items and
events, store, and its row of the dialect table (route.py)."""
