"""The descriptor pool of the client's generated protos (see generate.sh for why it is not
protobuf's default pool). The well-known types they import are added to it first."""

from google.protobuf import any_pb2, descriptor_pool, wrappers_pb2

POOL = descriptor_pool.DescriptorPool()
for _well_known in (any_pb2, wrappers_pb2):
    POOL.AddSerializedFile(_well_known.DESCRIPTOR.serialized_pb)
