"""Tensor parallelism: one model split over the devices (or CPU shares) of one worker replica."""
