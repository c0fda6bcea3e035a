"""Datasets: the ``Dataset`` record, data specs, and one module per data format holding its
probe and its reader (tensor files, tables, Arrow, CIFAR/MNIST folders, built-in sets)."""
