"""`/v1/chat/completions`: request models, translation to the worker, response models and
output, and its row of the dialect table (route.py)."""
