# shellcheck shell=bash
# Reproducible OCI image assembly shared by build-wasm-image.sh and build-companion-image.sh:
# blobs stored under their digest, a one-layer manifest, the layout's index, an optional copy of
# the layout, and the push with skopeo (the registry must store exactly the built digest).
# The caller defines info, die, and the variables LAYOUT, WORK, OCI_DIR, PUSH, TLS_VERIFY,
# AUTHFILE and IMAGE.

sha256() { sha256sum "$1" | cut -d' ' -f1; }
size() { wc -c <"$1" | tr -d ' '; }

# add_blob FILE: stores FILE in the layout under its digest and prints the digest.
add_blob() {
  local digest
  digest=$(sha256 "$1")
  cp "$1" "$LAYOUT/blobs/sha256/$digest"
  echo "$digest"
}

# oci_publish REF_NAME CONFIG_FILE LAYER_FILE LAYER_ANNOTATIONS_JSON HINT_PREFIX: writes the
# manifest (config + one gzip layer, the layer's annotations as given, e.g. `,"annotations":{…}`
# or empty) and the layout's index named REF_NAME, keeps a copy in OCI_DIR when set, pushes when
# PUSH=true, and prints the pinned reference (IMAGE@sha256:…), or the digest without a push.
oci_publish() {
  local ref_name=$1 config_file=$2 layer_file=$3 layer_annotations=$4 hint=$5
  local config_digest config_size layer_digest layer_size manifest_digest manifest_size pushed
  config_digest=$(add_blob "$config_file")
  config_size=$(size "$config_file")
  layer_digest=$(add_blob "$layer_file")
  layer_size=$(size "$layer_file")
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%s%s}]}' \
    "$config_digest" "$config_size" "$layer_digest" "$layer_size" "$layer_annotations" >"$WORK/manifest.json"
  manifest_digest=$(add_blob "$WORK/manifest.json")
  manifest_size=$(size "$WORK/manifest.json")
  printf '{"imageLayoutVersion":"1.0.0"}' >"$LAYOUT/oci-layout"
  printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"annotations":{"org.opencontainers.image.ref.name":"%s"}}]}' \
    "$manifest_digest" "$manifest_size" "$ref_name" >"$LAYOUT/index.json"
  info "image manifest sha256:$manifest_digest"
  if [ -n "$OCI_DIR" ]; then
    rm -rf "$OCI_DIR"
    mkdir -p "$(dirname "$OCI_DIR")"
    cp -r "$LAYOUT" "$OCI_DIR"
    info "OCI layout in $OCI_DIR (reference oci:$OCI_DIR:$ref_name)"
  fi
  if [ "$PUSH" = true ]; then
    local copy_args=(--quiet --preserve-digests --digestfile "$WORK/pushed-digest" "--dest-tls-verify=$TLS_VERIFY")
    if [ -n "$AUTHFILE" ]; then copy_args+=(--dest-authfile "$AUTHFILE"); fi
    info "pushing docker://$IMAGE"
    skopeo copy "${copy_args[@]}" "oci:$LAYOUT:$ref_name" "docker://$IMAGE" >&2 || die "pushing to $IMAGE failed"
    pushed=$(cat "$WORK/pushed-digest")
    [ "$pushed" = "sha256:$manifest_digest" ] ||
      die "the registry stored $pushed, not the built sha256:$manifest_digest"
    info "pushed; $hint${IMAGE%:*}@sha256:$manifest_digest"
    echo "${IMAGE%:*}@sha256:$manifest_digest"
  else
    echo "sha256:$manifest_digest"
  fi
}
