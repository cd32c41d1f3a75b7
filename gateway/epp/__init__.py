"""kvgate as a Gateway API Inference Extension Endpoint Picker (EPP): Envoy's ext_proc.

`kvgate epp` runs the same app as `kvgate serve` (settings, policies, lineage, admission,
pools, store, metrics), plus a `grpc.aio` server speaking
`envoy.service.ext_proc.v3.ExternalProcessor`. Envoy moves the bytes; kvgate decides.

* `gateway.epp.config`: the `epp:` settings section;
* `gateway.epp.wire`: protobuf in and out (headers, metadata, responses);
* `gateway.epp.addresses`: replica id <-> `ip:port`, the subset hint;
* `gateway.epp.exchange`: one ext_proc stream = one request, through the proxy's stages;
* `gateway.epp.server`: the gRPC server, its health services, the `Service` it runs as;
* `gateway.epp.inferencepool`: replicas from an InferencePool (Kubernetes API);
* `gateway.epp.cli`: the `kvgate epp` subcommand.
"""
