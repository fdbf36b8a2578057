"""Placeholder until the bench lands: argument hooks for `unmask bench` and `unmask eval`."""
import argparse


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    pass


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run_bench(args: argparse.Namespace) -> int:
    raise NotImplementedError


def run_eval(args: argparse.Namespace) -> int:
    raise NotImplementedError
