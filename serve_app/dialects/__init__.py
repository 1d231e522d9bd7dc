"""The request dialects the ingress speaks, one module (or package) each, and their table
(table.py); what they share lives below them, in serve_app/schema/."""
