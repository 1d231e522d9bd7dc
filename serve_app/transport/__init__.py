"""How the ingress calls a worker and gets its tokens: the one worker call (worker_call.py),
and one long-lived stream per worker replica that carries every step's chunks for this
ingress replica, each request reading its own mailbox."""
