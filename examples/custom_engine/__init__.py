"""A custom (non-vLLM) engine pair on kv-rendezvous: the way to integrate an engine of your own.

    python -m examples.custom_engine            # from the repository root, after `make setup-dev`
    python -m examples.custom_engine --auth     # the same against a service with tokens and bindings

It starts a real `kv-rendezvous serve` on a free loopback port, a decode engine and a prefill engine in
processes of their own, each with a DRAM KV pool registered with NIXL (UCX over loopback), and a minimal
router. Then it runs the three things an engine author has to get right:

1. requests: the router mints a transfer id and sends both legs at once; decode registers destination blocks,
   prefill computes its (stand-in) KV and hands the blocks to its agent, which WRITEs them into decode's pool;
   decode checks every byte;
2. a decode abort (the client went away): decode is told when its blocks are its own again, prefill gets its
   source blocks back;
3. a prefill killed (SIGKILL) after it took a request: decode is told PEER_LOST within prefill's lease, and gets
   its blocks back.

With `--auth` the service runs as docs/deploy.md configures it, TLS aside: each engine sends a token of its own,
bound to its id, role and pool, and the router signs each request's binding, which the engines present with their
targets and claims; a request the router did not sign is refused at both engines (BINDING_REQUIRED).

Files: `model.py` (the stand-in model: layout and KV), `decode.py`, `prefill.py` (the engines, around the SDK's
`ConsumerAgent` and `ProducerAgent`), `router.py` (the router and the engine processes), `secure.py` (`--auth`'s
auth file and binding key), `__main__.py` (the run).
"""
