"""Fixed English text for building prompts of chosen token lengths."""

PASSAGE = (
    "The river town woke slowly. Fishermen dragged their boats across the gravel while the baker "
    "pulled the first loaves from an oven that had burned since midnight. Children ran along the "
    "wall, counting the gulls and arguing about whether the old lighthouse had ever been lit. "
    "In the square, the clock struck seven, four minutes late as always, and the mayor frowned at "
    "it from his window as he had every morning for twenty-three years. Nobody remembered who had "
    "built the clock, but everybody had an opinion about how to fix it. The blacksmith said the "
    "pendulum was too short; the schoolteacher blamed the damp; the priest suggested patience. "
    "Meanwhile, a stranger stepped off the morning ferry carrying a leather case and a folded map. "
    "She asked the harbour master for the road to the mill, paid him with a coin nobody had seen "
    "before, and walked away before he could ask her name. By noon the whole town was talking "
    "about her. Some said she was a surveyor sent by the capital to plan a railway; others that "
    "she was the heir of the family who had owned the mill before the flood of 1887. The baker's "
    "daughter, who had served her a cup of tea, said only that she had asked many questions "
    "about the clock. That evening the clock struck seven exactly on time, and it has never been "
    "late since. Explain, step by step, what the stranger most likely did at the mill, why the "
    "townspeople reacted the way they did, and what the story suggests about how small "
    "communities deal with change, strangers, and the slow machinery of habit and memory. "
    "Then write a short poem about the clock, the river, the gulls and the ferry, and finish with "
    "a list of five questions a curious reader might still have about the town and its people."
)


def prompt_ids(tokenizer, length: int, offset: int = 0) -> list[int]:
    """`length` token ids cut from the passage (repeated as needed), starting at `offset`."""
    ids = tokenizer.encode(PASSAGE, add_special_tokens=False)
    while len(ids) < offset + length:
        ids = ids + ids
    return ids[offset: offset + length]
