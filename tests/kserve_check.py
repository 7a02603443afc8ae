"""Build a KServe object with the kserve SDK's own model classes: `python tests/kserve_check.py < doc.json`
prints {"built": CLASS, "predictor": [its set fields]} or {"error": "what is wrong, where"}.

A process of its own, because importing kserve registers its gRPC messages (`inference.*`) in
protobuf's default descriptor pool, where tritonclient's, imported by other tests, already are.
"""

from __future__ import annotations

import json
import re
import sys


def kserve_object(data, type_name: str, where: str = ""):  # noqa: ANN001, ANN201 - JSON in, SDK model out
    """`data` as the kserve SDK's `type_name` (a kserve or Kubernetes model class), field by field.

    The SDK's own deserializer drops unknown keys silently and cannot name Kubernetes' types, so this
    walks its classes' `openapi_types` itself: an unknown key, a wrong type or a missing required
    field (the classes' constructors check those) fails with the path to it.
    """
    import kserve.models
    import kubernetes.client.models

    # kserve's generated classes spell containers list[X] / dict(str, X), Kubernetes' List[X] / Dict[str, X]
    if items := re.fullmatch(r"[lL]ist\[(.*)\]", type_name):
        assert isinstance(data, list), f"{where}: expected a list"
        return [kserve_object(item, items.group(1), f"{where}[{i}]") for i, item in enumerate(data)]
    if values := re.fullmatch(r"dict\([^,]*, (.*)\)|Dict\[[^,]*, (.*)\]", type_name):
        value_type = values.group(1) or values.group(2)
        assert isinstance(data, dict), f"{where}: expected a mapping"
        return {key: kserve_object(value, value_type, f"{where}.{key}") for key, value in data.items()}
    primitive = {"str": str, "int": int, "float": (int, float), "bool": bool, "object": object}.get(type_name)
    if primitive is not None:
        assert isinstance(data, primitive) and not (primitive is int and isinstance(data, bool)), (
            f"{where}: {data!r} is not a {type_name}")
        return data
    cls = getattr(kserve.models, type_name, None) or getattr(kubernetes.client.models, type_name)
    assert isinstance(data, dict), f"{where}: expected a {type_name} mapping"
    by_key = {key: attr for attr, key in cls.attribute_map.items()}
    unknown = sorted(set(data) - set(by_key))
    assert not unknown, f"{where or type_name}: {type_name} has no field {', '.join(unknown)}"
    return cls(**{by_key[key]: kserve_object(value, cls.openapi_types[by_key[key]], f"{where}.{key}")
                  for key, value in data.items()})


def main() -> None:
    doc = json.load(sys.stdin)
    try:
        service = kserve_object(doc, "V1beta1InferenceService")
    except (AssertionError, ValueError) as exc:  # ours, or a required field the SDK's constructor missed
        print(json.dumps({"error": str(exc)}))
        return
    predictor = service.spec.predictor
    print(json.dumps({"built": type(service).__name__,
                      "predictor": [name for name in ("containers", "model") if getattr(predictor, name)]}))


if __name__ == "__main__":
    main()
