"""Thin views: parse, call one service or selector, present."""
