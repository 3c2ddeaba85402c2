import { defineConfig } from "vite";

// Served by the companion under `/ui/` (through the gateway: `/maas-api/ui/`), so asset URLs
// are relative: the same build works behind any prefix. JSX is compiled by esbuild
// (tsconfig "jsx": "react-jsx"); no plugin needed for a production build.
export default defineConfig({
  base: "./",
  build: {
    outDir: "dist",
    emptyOutDir: true,
    sourcemap: false,
    // The Content-Security-Policy allows scripts from the origin only: no inline module
    // preload polyfill.
    modulePreload: { polyfill: false },
    assetsInlineLimit: 0,
  },
  esbuild: { jsx: "automatic" },
});
