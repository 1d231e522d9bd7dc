"""How the ingress gets a worker's tokens: one long-lived stream per worker replica carries
every step's chunks for this ingress replica; each request reads its own mailbox."""
