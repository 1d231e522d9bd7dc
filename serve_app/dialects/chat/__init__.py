"""`/v1/chat/completions`: request models, translation to the worker, response models and output."""
