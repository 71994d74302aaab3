"""Plausible wrong answers to notebook 02's exercises, each failing for a reason the checker names."""


def _ceil_div(a, b):
    return -(-a // b)


def minus_null_block(available_bytes, bytes_per_token, block_size, max_model_len):
    """Subtracts the null block, which vLLM's logged figures do not."""
    blocks = max(available_bytes, 0) // (bytes_per_token * block_size) - 1
    return max(blocks, 0), max(blocks, 0) // _ceil_div(max_model_len, block_size)


def bytes_not_blocks(available_bytes, bytes_per_token, block_size, max_model_len):
    """Divides bytes by a request's bytes, forgetting that a request takes whole blocks."""
    blocks = max(available_bytes, 0) // (bytes_per_token * block_size)
    return blocks, max(available_bytes, 0) // (bytes_per_token * max_model_len)


def counts_the_null_block(num_blocks, block_size, concurrency):
    """Shares every block, the null block included."""
    return (num_blocks // concurrency) * block_size


def divides_tokens(num_blocks, block_size, concurrency):
    """Shares token slots instead of whole blocks."""
    return (num_blocks - 1) * block_size // concurrency


WRONG = {
    "02.num_blocks": [
        (minus_null_block, "count the null block"),
        (bytes_not_blocks, "whole blocks"),
    ],
    "02.max_model_len_for": [
        (counts_the_null_block, "null block"),
        (divides_tokens, "multiple of block_size"),
    ],
}
