"""kimi_vocab: the ground floor's shared vocabulary, names every other package speaks (the effort
levels). It imports nothing but the standard library, so envs, policy, rl and the dashboard can
all import it without loading torch or each other."""
