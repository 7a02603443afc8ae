"""client/protos were written from the protocols' definitions, not copied: every message, field
and enum value in them must match the definitions the reference implementations ship
(TensorFlow's and tensorflow-serving-api's for TF Serving's API, tritonclient's for V2), field by
field: same number, type, repeatedness and message type name. A subset is fine (the client leaves
out what it never sends); a difference is not."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest
from google.protobuf import descriptor_pool
from serve_process import REPO

import client.protos


def _client_files():
    for module in pkgutil.iter_modules(client.protos.__path__):
        if module.name.endswith("_pb2"):
            yield importlib.import_module(f"client.protos.{module.name}").DESCRIPTOR


def _messages(descriptor):
    yield descriptor
    for nested in descriptor.nested_types:
        yield from _messages(nested)


def _field_signature(field):
    kind = field.message_type.full_name if field.message_type else field.enum_type.full_name if field.enum_type else None
    return field.number, field.type, field.is_repeated, kind


@pytest.fixture(scope="module")
def reference_pool():
    """The default pool, with the reference definitions of every package client/protos defines."""
    import tensorflow_serving.apis.get_model_metadata_pb2  # noqa: F401
    import tensorflow_serving.apis.get_model_status_pb2  # noqa: F401
    import tensorflow_serving.apis.model_service_pb2  # noqa: F401
    import tensorflow_serving.apis.prediction_service_pb2  # noqa: F401
    import tritonclient.grpc.service_pb2  # noqa: F401

    return descriptor_pool.Default()


def test_every_message_and_enum_matches_the_reference_definitions(reference_pool):
    checked = 0
    for file in _client_files():
        for top in file.message_types_by_name.values():
            for message in _messages(top):
                if message.GetOptions().map_entry:
                    continue
                reference = reference_pool.FindMessageTypeByName(message.full_name)
                for field in message.fields:
                    theirs = reference.fields_by_name.get(field.name)
                    assert theirs is not None, f"{message.full_name}.{field.name} is not in the reference"
                    assert _field_signature(field) == _field_signature(theirs), f"{message.full_name}.{field.name}"
                    checked += 1
        for enum in file.enum_types_by_name.values():
            reference = reference_pool.FindEnumTypeByName(enum.full_name)
            assert {v.name: v.number for v in enum.values} == {v.name: v.number for v in reference.values}
            checked += 1
        for service in file.services_by_name.values():
            reference = reference_pool.FindServiceByName(service.full_name)
            for method in service.methods:
                theirs = reference.methods_by_name[method.name]
                assert (method.input_type.full_name, method.output_type.full_name) == (
                    theirs.input_type.full_name, theirs.output_type.full_name)
                checked += 1
    assert checked > 100


def test_the_generated_modules_are_what_generate_sh_makes_of_the_protos(tmp_path):
    """Nobody edited the generated code by hand, and nobody changed a .proto without regenerating:
    the .proto files compile (protoc from grpcio-tools) to the checked-in descriptors."""
    protos = sorted((REPO / "client" / "protos").glob("*.proto"))
    out = tmp_path / "descriptors.binpb"
    # In a process of its own: protoc's C++ and TensorFlow's, loaded in one process, crash it.
    code = ("import sys, importlib.resources\nfrom grpc_tools import protoc\n"
            "well_known = str(importlib.resources.files('grpc_tools') / '_proto')\n"
            "sys.exit(protoc.main(['protoc', '-I.', '-I' + well_known, *sys.argv[1:]]))")
    result = subprocess.run([sys.executable, "-c", code, f"--descriptor_set_out={out}",
                             *(str(p.relative_to(REPO)) for p in protos)], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    from google.protobuf import descriptor_pb2

    compiled = {f.name: _without_json_names(f) for f in descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file}
    for file in _client_files():
        checked_in = _without_json_names(descriptor_pb2.FileDescriptorProto.FromString(file.serialized_pb))
        assert checked_in == compiled[file.name], f"{file.name}: run client/protos/generate.sh"


def _without_json_names(file):  # noqa: ANN001, ANN202 - a FileDescriptorProto
    """protoc writes every field's json_name into a descriptor set, generated code only the
    explicit ones: compare without them."""
    def clear(messages):
        for message in messages:
            for field in message.field:
                field.ClearField("json_name")
            clear(message.nested_type)
    clear(file.message_type)
    return file


def test_the_protos_load_beside_tensorflows_and_tritonclients_in_any_order():
    """One process, both definitions of tensorflow.TensorProto and inference.ModelInferRequest: the
    client's live in their own descriptor pool, so neither import order fails."""
    for first, second in [("client.protos.predict_pb2", "tensorflow_serving.apis.predict_pb2"),
                          ("tritonclient.grpc.service_pb2", "client.protos.grpc_predict_v2_pb2")]:
        for order in ((first, second), (second, first)):
            code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\nprint('ok')"
            result = subprocess.run([sys.executable, "-c", code, *order], cwd=REPO, capture_output=True, text=True,
                                    timeout=120)
            assert result.stdout.strip() == "ok", result.stderr[-2000:]
