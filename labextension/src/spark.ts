/**
 * A rank's history as small lines: CPU % (and GPU %, where a rank uses a GPU) on a 0-100
 * scale, RSS scaled to its own maximum.  The drawing stretches to its cell's width (the
 * sidebar may be narrow), its strokes keep their width.
 */

const SVG = 'http://www.w3.org/2000/svg';
const WIDTH = 80;
const HEIGHT = 16;

export function sparklines(cpu: (number | null)[], rss: (number | null)[], gpu: (number | null)[] = []): SVGElement {
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('viewBox', `0 0 ${WIDTH} ${HEIGHT}`);
  svg.setAttribute('preserveAspectRatio', 'none');
  svg.setAttribute('class', 'mk-Spark');
  const line = (values: (number | null)[], top: number, cls: string) => {
    const n = values.length;
    const pts = values
      .map((v, i) => (v === null ? null : `${((i / Math.max(1, n - 1)) * WIDTH).toFixed(1)},${(HEIGHT - 1 - (Math.min(v, top) / (top || 1)) * (HEIGHT - 2)).toFixed(1)}`))
      .filter((p): p is string => p !== null);
    const el = document.createElementNS(SVG, 'polyline');
    el.setAttribute('points', pts.join(' '));
    el.setAttribute('class', cls);
    svg.appendChild(el);
  };
  line(cpu, 100, 'mk-Spark-cpu');
  const known = rss.filter((v): v is number => v !== null);
  line(rss, known.length ? Math.max(...known) : 1, 'mk-Spark-rss');
  if (gpu.some(v => v !== null)) {
    line(gpu, 100, 'mk-Spark-gpu');
  }
  return svg;
}
