"""Reading a choice's text: reasoning, content and tool calls (streamed and whole)."""
