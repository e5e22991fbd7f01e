"""Tests of `proto/`: the wire messages and codecs, the message pipe, validated configs."""
