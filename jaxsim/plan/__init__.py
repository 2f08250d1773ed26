"""Plans for TPU pods made on any machine: the real train step and encode program compiled
for a named topology (libtpu's compiler, no TPU attached) and read back as memory, cost,
collectives and a roofline step time (`python -m jaxsim plan`, docs/pod.md)."""
