"""What the dialects and the output parsers share, below both: request and response bases,
sampling fields, `response_format`, tool definitions, and the `Dialect` row each dialect supplies."""
