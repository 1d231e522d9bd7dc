"""`/v1/responses` (OpenAI's Responses API): request, chat translation, output items and events, store."""
