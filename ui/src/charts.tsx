/** Charts drawn with plain elements (no chart library, nothing inline the CSP refuses). */

/** The exact sum of two non-negative decimal strings (the API's `cost`): no float rounding. */
export function addDecimal(a: string, b: string): string {
  const [ai, af = ""] = a.split(".");
  const [bi, bf = ""] = b.split(".");
  const scale = Math.max(af.length, bf.length);
  const sum = BigInt((ai || "0") + af.padEnd(scale, "0")) + BigInt((bi || "0") + bf.padEnd(scale, "0"));
  if (scale === 0) return sum.toString();
  const digits = sum.toString().padStart(scale + 1, "0");
  const fraction = digits.slice(-scale).replace(/0+$/, "");
  const whole = digits.slice(0, -scale);
  return fraction ? `${whole}.${fraction}` : whole;
}

/** A decimal string's value for a bar's length only (the figures shown stay exact). */
function magnitude(d: string): number {
  const n = Number(d);
  return Number.isFinite(n) ? n : 0;
}

/** The colour of the i-th series: distinct for the first ten, then repeating. */
export function seriesColour(i: number): string {
  const palette = ["#2f6fde", "#e07b39", "#3aa76d", "#b4479c", "#c9a227", "#1f9eaa", "#d64545", "#6b5bd6", "#7a8a99", "#8c5a2b"];
  return palette[i % palette.length] ?? "#2f6fde";
}

export interface StackedRow {
  label: string;
  /** Value per series (a decimal string), in the order of `series`. */
  parts: string[];
}

/** One bar per row, split by series, all scaled to the largest row; the total at the end. */
export function StackedBars({ id, series, rows, format }: {
  id: string;
  series: string[];
  rows: StackedRow[];
  format: (total: string) => string;
}) {
  const totals = rows.map((r) => r.parts.reduce((s, p) => addDecimal(s, p), "0"));
  const max = Math.max(...totals.map(magnitude), Number.MIN_VALUE);
  return (
    <div className="bars" id={id}>
      {series.length > 1 && (
        <div className="legend">
          {series.map((s, i) => (
            <span className="legend-item" key={s}>
              <span className="swatch" style={{ background: seriesColour(i) }} />
              {s}
            </span>
          ))}
        </div>
      )}
      {rows.map((r, i) => (
        <div className="bar-row" key={r.label}>
          <span className="bar-label">{r.label}</span>
          <span className="bar" style={{ width: `${(100 * magnitude(totals[i] ?? "0")) / max}%` }}>
            {r.parts.map((p, j) =>
              magnitude(p) > 0 ? (
                <span
                  className="seg"
                  key={series[j] ?? j}
                  title={`${series[j] ?? ""}: ${format(p)}`}
                  style={{ width: `${(100 * magnitude(p)) / (magnitude(totals[i] ?? "0") || 1)}%`, background: seriesColour(j) }}
                />
              ) : null,
            )}
          </span>
          <span className="bar-value">{format(totals[i] ?? "0")}</span>
        </div>
      ))}
    </div>
  );
}
