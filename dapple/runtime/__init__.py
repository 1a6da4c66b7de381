"""The runtime: fx stage split, split-concat P2P, dapple/gpipe schedules, pipeline engine, checkpoints."""
