"""Speculative decoding: proposers guess a sequence's next tokens, one forward pass of the target
model checks them all, and the rejection sampler keeps the longest prefix the target agrees with."""
