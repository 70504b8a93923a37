#!/usr/bin/env bash
# Prints an image's layers in buildah's store: size (the uncompressed layer, as `docker history`
# shows it) and the step that made each, then the total.   image/layers.sh localhost/kvpilot:dev
set -euo pipefail
buildah --storage-driver "${STORAGE_DRIVER:-vfs}" inspect --type image "${1:?image}" | python3 -c '
import json, sys
image = json.load(sys.stdin)
layers = json.loads(image["Manifest"])["layers"]
steps = [h.get("created_by", "") for h in image["OCIv1"].get("history", [])
         if not h.get("empty_layer")]
# An imported base has one layer per history entry it kept; pad when it kept none.
steps = ["(base)"] * (len(layers) - len(steps)) + steps
total = 0
for layer, step in zip(layers, steps):
    total += layer["size"]
    print("%9.1f MB  %s" % (layer["size"] / 1e6, " ".join(step.split())[:110]))
print("%9.1f MB  total (%.1f MiB)" % (total / 1e6, total / 2**20))
'
