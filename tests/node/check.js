// A second gRPC client implementation against `python -m serve`: @grpc/grpc-js (Node's own HTTP/2)
// calls TF Serving's Predict, KServe V2's ModelInfer, gRPC health and a call past its deadline, and
// prints one JSON line with what came back; tests/test_grpc_node.py checks it.
//   node check.js TARGET MODEL REVIEW...
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [target, model, ...reviews] = process.argv.slice(2);
const repo = path.resolve(__dirname, "..", "..");
const definitions = protoLoader.loadSync(
  ["client/protos/prediction_service.proto", "client/protos/grpc_predict_v2.proto",
    path.join(__dirname, "health.proto")],
  { includeDirs: [repo], keepCase: true, longs: Number, enums: String, defaults: true });
const loaded = grpc.loadPackageDefinition(definitions);
const credentials = grpc.credentials.createInsecure();
const predictions = new loaded.tensorflow.serving.PredictionService(target, credentials);
const inference = new loaded.inference.GRPCInferenceService(target, credentials);
const health = new loaded.grpc.health.v1.Health(target, credentials);

function call(client, method, request, seconds = 20) {
  const deadline = new Date(Date.now() + seconds * 1000);
  return new Promise((resolve) => {
    client[method](request, { deadline }, (error, answer) => {
      resolve(error ? { code: grpc.status[error.code], details: error.details } : { answer });
    });
  });
}

function decodeBytes(raw) {
  // KServe V2's raw BYTES tensor: each element a 4-byte little-endian length, then its bytes.
  const out = [];
  for (let at = 0; at < raw.length;) {
    const size = raw.readUInt32LE(at);
    out.push(raw.subarray(at + 4, at + 4 + size).toString());
    at += 4 + size;
  }
  return out;
}

function floats(tensor) {
  // A TensorProto's floats: packed in tensor_content (as TF Serving answers) or in float_val.
  if (tensor.tensor_content.length > 0) {
    return Array.from(new Float32Array(new Uint8Array(tensor.tensor_content).buffer));
  }
  return tensor.float_val;
}

function outputValues(output, raw) {
  // Raw contents where the server sent them (as it does to tritonclient), else the typed fields.
  if (raw !== undefined) {
    return output.datatype === "BYTES" ? decodeBytes(raw)
      : Array.from(new Float32Array(new Uint8Array(raw).buffer));
  }
  return output.datatype === "BYTES" ? output.contents.bytes_contents.map((b) => b.toString())
    : output.contents.fp32_contents;
}

async function main() {
  const texts = reviews.map((r) => Buffer.from(r));
  const predict = await call(predictions, "Predict", {
    model_spec: { name: model },
    inputs: { text: { dtype: "DT_STRING", tensor_shape: { dim: [{ size: texts.length }] }, string_val: texts } },
  });
  const infer = await call(inference, "ModelInfer", {
    model_name: model, id: "node-1",
    inputs: [{ name: "text", datatype: "BYTES", shape: [texts.length], contents: { bytes_contents: texts } }],
  });
  const serving = await call(health, "Check", { service: "" });
  const unknown = await call(predictions, "Predict", { model_spec: { name: "no-such-model" }, inputs: {} });
  const late = await call(predictions, "Predict", {
    model_spec: { name: model },
    inputs: { text: { dtype: "DT_STRING", tensor_shape: { dim: [{ size: 1 }] }, string_val: [texts[0]] } },
  }, Number(process.env.DEADLINE_S || "0.2"));

  const result = {
    predict: predict.answer ? {
      model: predict.answer.model_spec.name,
      labels: predict.answer.outputs.label.string_val.map((b) => b.toString()),
      probabilities: floats(predict.answer.outputs.probabilities),
    } : predict,
    infer: infer.answer ? {
      id: infer.answer.id,
      outputs: Object.fromEntries(infer.answer.outputs.map((o, i) => [o.name, {
        datatype: o.datatype, shape: o.shape, values: outputValues(o, infer.answer.raw_output_contents[i]),
      }])),
    } : infer,
    health: serving.answer ? serving.answer.status : serving,
    unknown_model: unknown,
    past_deadline: late.code || "OK",
  };
  console.log(JSON.stringify(result));
  for (const client of [predictions, inference, health]) client.close();
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
