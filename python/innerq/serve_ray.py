"""innerq replicas behind Ray Serve.

Each replica is `innerq serve`'s application (innerq.server: one engine whose requests are
decoded together) as a Ray Serve ingress deployment. Ray Serve's HTTP proxy spreads the OpenAI
API's requests over the replicas with its request router (by default the power of two choices
by requests in flight, each replica taking at most --parallel + --queue at once) and, with
--min-replicas / --max-replicas, adds and removes replicas to keep about --parallel requests in
flight on each. A replica is ready once its model is loaded.

Each replica reports the gauges that a gateway's scheduler reads (llm-d's inference
scheduler: requests waiting, requests running, KV cache usage; innerq.server.metrics) in two
places: as its routing statistics (`record_routing_stats`, which Ray Serve hands to a request
router that reads them, e.g. a RequestRouter subclass given as request_router_config), and as
Ray metrics (innerq_requests_waiting, innerq_requests_running, innerq_kv_cache_usage, tagged
with the replica), which Ray's metrics export serves to Prometheus.

    python -m innerq.serve_ray MODEL --replicas 2 -np 8 --port 8000   # then the OpenAI API on :8000/v1
    python -m innerq.serve_ray MODEL --min-replicas 1 --max-replicas 4

It needs Ray Serve (`pip install "ray[serve]"`) and innerq[server].
"""
from __future__ import annotations

import argparse
import sys
import time

from ray import serve
from ray.util import metrics as ray_metrics

from . import cli


@serve.ingress()
class InnerQReplica:
    """One replica: `innerq serve`'s application over its own engine (args: innerq serve's
    parsed command line)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.engine = None
        tags = ("replica",)
        self.gauges = {name: ray_metrics.Gauge(f"innerq_{name}", description=doc, tag_keys=tags) for name, doc in (
            ("requests_waiting", "Requests waiting for a sequence or room in the KV pool"),
            ("requests_running", "Requests decoding or reading their prompts"),
            ("kv_cache_usage", "Share of the KV pool reserved by running requests, 0 to 1"))}
        self.replica = serve.get_replica_context().replica_tag

    def __serve_build_asgi_app__(self):
        from .server import make

        self.engine, app, _names = make(self.args)
        self.engine.start()
        if self.engine.wait_loaded() == "failed":
            raise RuntimeError(f"innerq: the model failed to load: {self.engine.error}")
        return app

    def record_routing_stats(self) -> dict:
        """The gauges a gateway's scheduler reads, for Ray Serve's request router (and set as
        this replica's Ray metrics)."""
        s = self.engine.stats()
        stats = {"requests_waiting": s["waiting"], "requests_running": s["running"],
                 "kv_cache_usage": s["reserved"] / s["n_pages"] if s["n_pages"] else 0.0}
        for name, value in stats.items():
            self.gauges[name].set(value, tags={"replica": self.replica})
        return stats

    def check_health(self) -> None:
        if self.engine is not None and self.engine.state == "failed":
            raise RuntimeError(f"innerq: the model failed to load: {self.engine.error}")


def build_app(args: argparse.Namespace, replicas: int = 1, min_replicas: int | None = None,
              max_replicas: int | None = None, cpus: float = 1.0):
    """The Ray Serve application of innerq replicas (args: `innerq serve`'s parsed command
    line; --host and --port are Ray Serve's, given to serve.start). replicas: a fixed count;
    min_replicas and max_replicas: autoscaling between them instead, about args.parallel
    requests in flight per replica. cpus: the CPUs Ray reserves for each replica (its threads
    are -t)."""
    options = {"name": "innerq", "max_ongoing_requests": args.parallel + args.queue,
               "ray_actor_options": {"num_cpus": cpus},
               "request_router_config": {"request_routing_stats_period_s": 2}}
    if min_replicas is not None or max_replicas is not None:
        options["autoscaling_config"] = {"min_replicas": min_replicas or 1,
                                         "max_replicas": max_replicas or max(min_replicas or 1, replicas),
                                         "target_ongoing_requests": args.parallel}
    else:
        options["num_replicas"] = replicas
    return serve.deployment(InnerQReplica).options(**options).bind(args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m innerq.serve_ray",
                                 description="innerq serve's replicas behind Ray Serve (on the Ray cluster of "
                                 "RAY_ADDRESS, else a local one). The flags of `innerq serve`, and:")
    cli.add_serve_args(ap)
    ap.add_argument("--replicas", type=int, default=1, help="replicas (default 1)")
    ap.add_argument("--min-replicas", type=int, help="autoscale from this many replicas")
    ap.add_argument("--max-replicas", type=int, help="autoscale up to this many replicas")
    ap.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves per replica (default 1)")
    args = ap.parse_args(argv)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(args, args.replicas, args.min_replicas, args.max_replicas, args.cpus_per_replica),
              name="innerq", route_prefix="/")
    print(f"innerq: {args.replicas if args.min_replicas is None else 'autoscaled'} replica(s) on "
          f"http://{args.host}:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
