#!/usr/bin/env bash
# Regenerates the Python modules beside this script from the .proto files here:
#   python -m venv /tmp/protoc && /tmp/protoc/bin/pip install grpcio-tools==1.66.2
#   PYTHON=/tmp/protoc/bin/python client/protos/generate.sh
# grpcio-tools 1.66.2 bundles protoc 27.2, so the generated code runs on protobuf >= 5.27.2 and
# grpcio >= 1.66.2 (the client's [grpc] extra says so); newer tools would raise both floors.
#
# The messages go into a descriptor pool of their own (client/protos/_pool.py), not protobuf's
# default pool: a process may also load TensorFlow's or tritonclient's definitions of the same
# messages (tensorflow.TensorProto, inference.ModelInferRequest), and one pool refuses a
# second definition of a name. protoc has no option for it, hence the rewrite after it.
set -euo pipefail
cd "$(dirname "$0")/../.."
"${PYTHON:-python}" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. client/protos/*.proto
sed -i \
    -e 's/^from google.protobuf import descriptor_pool as _descriptor_pool$/from client.protos import _pool/' \
    -e 's/_descriptor_pool\.Default()/_pool.POOL/' \
    client/protos/*_pb2.py
# A service-less file gets an empty *_pb2_grpc.py: nothing imports those.
for stub in client/protos/*_pb2_grpc.py; do
    grep -q "Stub(object)" "$stub" || rm "$stub"
done
